"""The one definition of sampling controls: fields, defaults, limits and their checks.

The gateway (public fields) and the engine (its GenerateRequest) both validate with the
functions here, so a value one accepts the other accepts too, with the same message. The
field names are those of `tokenserve.common.v1.SamplingParams`; the protobuf conversions
are derived from the dataclass's fields, so a new control is one field here and one in the
proto.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Sequence

from tokenserve.common.v1 import common_pb2
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.text import check_no_nul

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
PENALTY_LIMIT = 2.0
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request; the defaults are greedy with no penalties."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Same seed and prompt give the same output whatever else runs; None: unseeded.
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty differs from its default (which leaves the logits as they are)."""
        return (self.repetition_penalty != _DEFAULT.repetition_penalty
                or self.presence_penalty != _DEFAULT.presence_penalty
                or self.frequency_penalty != _DEFAULT.frequency_penalty)


_DEFAULT = SamplingParams()
# The controls in the order of the proto message; subclasses add fields after these.
FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


def _finite(name: str, v: float) -> None:
    if not math.isfinite(v):
        raise InvalidArgument(f"{name} must be a finite number, got {v}")


def check_sampling(p: SamplingParams) -> None:
    """InvalidArgument naming the first control outside its range."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        _finite(name, getattr(p, name))
    if p.temperature < 0:
        raise InvalidArgument(f"temperature must be >= 0 (0 is greedy), got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise InvalidArgument(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {p.top_k}")
    if not 0.0 <= p.min_p <= 1.0:
        raise InvalidArgument(f"min_p must be in [0, 1], got {p.min_p}")
    if not 0.0 < p.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidArgument(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]"
                              f" (1 disables it), got {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
            raise InvalidArgument(
                f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {v}")
    if p.seed is not None and not 0 <= p.seed < 2 ** 64:
        raise InvalidArgument(f"seed must be in 0..2^64-1, got {p.seed}")


def check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}] must be 1-{MAX_STOP_CHARS} characters, got {len(s)}")
        check_no_nul(s, f"stop[{i}]")


def check_top_logprobs(top_logprobs: int) -> None:
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}")


# -- protobuf (common.v1.SamplingParams) ------------------------------------------------------

def set_fields(msg: common_pb2.SamplingParams) -> dict[str, Any]:
    """The controls a caller set explicitly in `msg` (unset optional fields are absent)."""
    return {name: getattr(msg, name) for name in FIELDS if msg.HasField(name)}


def to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{name: getattr(p, name) for name in FIELDS
                                        if getattr(p, name) is not None})
