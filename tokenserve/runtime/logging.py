"""structlog JSON lines on stderr for every service.

Never log prompt or completion text: log ids, counts and timings only.
"""
from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger().bind(service=service)


def get_logger(**bind) -> structlog.stdlib.BoundLogger:
    # Lazy: module-level loggers created before configure_logging() still log JSON.
    return structlog.get_logger(**bind)
