"""Checks every Generate input before any compute; each failure names the field and limit.

Runs in the asyncio front on domain values (the servicer converts protobuf first), so a bad
request never reaches the step thread.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.engine.interface import SamplingParams
from tokenserve.runtime.errors import InvalidArgument
from tokenserve.sampling import check_sampling, check_stop, check_top_logprobs

MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True)
class ModelLimits:
    max_context: int
    vocab_size: int


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
    check_sampling(sampling)
    check_top_logprobs(sampling.top_logprobs)
    check_stop(stop)
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids has {len(stop_token_ids)} ids; at most"
                              f" {MAX_STOP_TOKEN_IDS} are allowed")
    _check_ids("stop_token_ids", stop_token_ids, vocab)


def _check_ids(name: str, ids: list[int], vocab: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab):
        return
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise InvalidArgument(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab})")
