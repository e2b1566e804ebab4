"""Checks a public request before any downstream call; messages name the field and the limit.

The engine checks sampling ranges too; failing here first saves a tokenizer round trip and
gives the caller the public field name.
"""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass, field, replace

from tokenserve.runtime.errors import InvalidArgument

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 200
MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1000
MAX_TOP_LOGPROBS = 20
MAX_APP_CHARS = 64
CHAT_ROLES = ("system", "user", "assistant")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True)
class Sampling:
    """Sampling controls as the caller set them; None means "service default"."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class InferenceRequest:
    """A Generate (prompt) or Chat (messages) call, protobuf-free."""

    model: str
    max_tokens: int
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    app: str = ""
    logprobs: bool = False
    top_logprobs: int = 0
    # Speculative decoding; None: the engine's setting.
    speculation: bool | None = None


def _finite(name: str, v: float | None):
    if v is not None and not math.isfinite(v):
        raise InvalidArgument(f"{name} must be a finite number, got {v}")


def check_sampling(s: Sampling) -> None:
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        _finite(name, getattr(s, name))
    if s.temperature is not None and s.temperature < 0:
        raise InvalidArgument(f"temperature must be >= 0 (0 is greedy), got {s.temperature}")
    if s.top_p is not None and not 0 < s.top_p <= 1:
        raise InvalidArgument(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k is not None and s.top_k < 0:
        raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {s.top_k}")
    if s.min_p is not None and not 0 <= s.min_p <= 1:
        raise InvalidArgument(f"min_p must be in [0, 1], got {s.min_p}")
    if s.repetition_penalty is not None and s.repetition_penalty <= 0:
        raise InvalidArgument(
            f"repetition_penalty must be > 0 (1 disables it), got {s.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        if v is not None and not -2 <= v <= 2:
            raise InvalidArgument(f"{name} must be in [-2, 2], got {v}")


def check_max_tokens(max_tokens: int, tier_cap: int, tier: str) -> None:
    if max_tokens < 1:
        raise InvalidArgument(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens > tier_cap:
        raise InvalidArgument(
            f"max_tokens is {max_tokens}; the {tier} tier allows at most {tier_cap}")


def check_messages(messages: tuple[Message, ...] | None) -> None:
    if not messages:
        raise InvalidArgument("messages must hold at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages holds {len(messages)}; at most {MAX_MESSAGES}")
    total = 0
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role!r}")
        total += len(m.content)
    if not any(m.content for m in messages):
        raise InvalidArgument("messages: every content is empty")
    if total > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"messages hold {total} characters; at most {MAX_PROMPT_CHARS}")


def check_prompt(prompt: str | None) -> None:
    if not prompt:
        raise InvalidArgument("prompt must not be empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")


def validate(req: InferenceRequest, *, tier_cap: int, tier: str) -> InferenceRequest:
    """The request with a request id filled in; InvalidArgument on the first bad field."""
    if req.messages is None:
        check_prompt(req.prompt)
    else:
        check_messages(req.messages)
    check_max_tokens(req.max_tokens, tier_cap, tier)
    check_sampling(req.sampling)
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop holds {len(req.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(req.stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}] must be 1-{MAX_STOP_CHARS} characters")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {req.top_logprobs}")
    if len(req.app) > MAX_APP_CHARS:
        raise InvalidArgument(f"app is {len(req.app)} characters; at most {MAX_APP_CHARS}")
    if req.request_id and not _REQUEST_ID_RE.match(req.request_id):
        raise InvalidArgument(
            "request_id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    return req if req.request_id else replace(req, request_id=uuid.uuid4().hex)


def check_context(prompt_tokens: int, max_tokens: int, max_context: int | None) -> None:
    """After tokenizing: the prompt and the completion must fit the model's context."""
    if max_context and prompt_tokens + max_tokens > max_context:
        raise InvalidArgument(
            f"prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}; together they"
            f" must be <= the model's context of {max_context} tokens")
