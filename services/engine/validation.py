"""Checks every Generate input before any compute; each failure names the field and limit.

Runs in the asyncio front on domain values (the servicer converts protobuf first), so a bad
request never reaches the step thread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.engine.interface import SamplingParams
from tokenserve.runtime.errors import InvalidArgument

MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
PENALTY_LIMIT = 2.0
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class ModelLimits:
    max_context: int
    vocab_size: int


def validate_sampling(p: SamplingParams) -> None:
    _finite("sampling.temperature", p.temperature)
    if p.temperature < 0:
        raise InvalidArgument(f"sampling.temperature must be >= 0 (0 is greedy), got {p.temperature}")
    _finite("sampling.top_p", p.top_p)
    if not 0.0 < p.top_p <= 1.0:
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < 0:
        raise InvalidArgument(f"sampling.top_k must be >= 0 (0 disables it), got {p.top_k}")
    _finite("sampling.min_p", p.min_p)
    if not 0.0 <= p.min_p <= 1.0:
        raise InvalidArgument(f"sampling.min_p must be in [0, 1], got {p.min_p}")
    _finite("sampling.repetition_penalty", p.repetition_penalty)
    if not 0.0 < p.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise InvalidArgument("sampling.repetition_penalty must be in (0, "
                              f"{MAX_REPETITION_PENALTY:g}] (1 disables it), got {p.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        _finite(f"sampling.{name}", v)
        if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
            raise InvalidArgument(f"sampling.{name} must be in [-{PENALTY_LIMIT:g}, "
                                  f"{PENALTY_LIMIT:g}], got {v}")
    if not 0 <= p.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs}")


def validate_request(prompt_token_ids: list[int], sampling: SamplingParams, max_tokens: int,
                     stop: list[str], stop_token_ids: list[int], limits: ModelLimits) -> None:
    n, ctx, vocab = len(prompt_token_ids), limits.max_context, limits.vocab_size
    if n == 0:
        raise InvalidArgument("prompt_token_ids must not be empty")
    if n >= ctx:
        raise InvalidArgument(f"prompt_token_ids has {n} tokens; the model context is {ctx} tokens,"
                              f" so a prompt may have at most {ctx - 1}")
    _check_ids("prompt_token_ids", prompt_token_ids, vocab)
    if max_tokens <= 0:
        raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}")
    if n + max_tokens > ctx:
        raise InvalidArgument(f"max_tokens {max_tokens} plus the {n} prompt tokens exceeds the model"
                              f" context of {ctx} tokens; max_tokens may be at most {ctx - n}")
    validate_sampling(sampling)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(stop):
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidArgument(f"stop[{i}] must have 1 to {MAX_STOP_STRING_CHARS} characters,"
                                  f" got {len(s)}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids has {len(stop_token_ids)} ids; at most"
                              f" {MAX_STOP_TOKEN_IDS} are allowed")
    _check_ids("stop_token_ids", stop_token_ids, vocab)


def _finite(name: str, v: float) -> None:
    if not math.isfinite(v):
        raise InvalidArgument(f"{name} must be a finite number, got {v}")


def _check_ids(name: str, ids: list[int], vocab: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InvalidArgument(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})")
