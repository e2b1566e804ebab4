"""Registers an engine, prints "registered", then waits to be killed (run by test_registry)."""
from __future__ import annotations

import asyncio
import sys

from controlplane.registry import register
from controlplane.schema import EngineRegistration
from tokenserve.runtime.logging import configure_logging


async def main(endpoint: str, engine_id: str, ttl: int) -> None:
    reg = EngineRegistration(engine_id, "127.0.0.1:1", "smollm2-135m-instruct", "q4_1", 8)
    await register([endpoint], "engines", reg, ttl=ttl)
    print("registered", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    configure_logging("register-child")  # logs to stderr; stdout carries the handshake
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
