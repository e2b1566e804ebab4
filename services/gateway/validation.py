"""Checks a public request before any downstream call; messages name the field and the limit.

The engine checks sampling ranges too, with the same rules (tokenserve.sampling); failing
here first saves a tokenizer round trip.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field, replace

from tokenserve.runtime.errors import InvalidArgument
from tokenserve.sampling import SamplingParams, check_sampling, check_stop, check_top_logprobs
from tokenserve.text import check_no_nul
from tokenserve.tokenization import MAX_TEXT_BYTES

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1000
MAX_APP_CHARS = 64
CHAT_ROLES = ("system", "user", "assistant")
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# `x-session-id`: gRPC metadata or an HTTP header, the same on both adapters.
SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 128
_SESSION_ID_RE = re.compile(r"^[\x21-\x7e]{1,%d}$" % MAX_SESSION_ID_CHARS)


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
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    app: str = ""
    logprobs: bool = False
    top_logprobs: int = 0
    # Speculative decoding; None: the engine's setting.
    speculation: bool | None = None
    # The caller's conversation (`x-session-id`): one session stays on one model version.
    session_id: str = ""


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
        check_no_nul(m.content, f"messages[{i}].content")
        total += len(m.content)
    if not any(m.content for m in messages):
        raise InvalidArgument("messages: every content is empty")
    if total > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"messages hold {total} characters; at most {MAX_PROMPT_CHARS}")
    if total * 4 > MAX_TEXT_BYTES:
        _check_bytes(sum(len(m.content.encode("utf-8")) for m in messages), "messages")


def check_prompt(prompt: str | None) -> None:
    if not prompt:
        raise InvalidArgument("prompt must not be empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"prompt is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")
    check_no_nul(prompt, "prompt")
    if len(prompt) * 4 > MAX_TEXT_BYTES:  # a character is 1..4 bytes: measure only when it may be over
        _check_bytes(len(prompt.encode("utf-8")), "prompt")


def _check_bytes(size: int, field: str) -> None:
    # The tokenizer refuses larger inputs; the gateway says so before tokenizing, either way.
    if size > MAX_TEXT_BYTES:
        raise InvalidArgument(f"{field} is {size} bytes of UTF-8; at most {MAX_TEXT_BYTES}")


def validate(req: InferenceRequest, *, tier_cap: int, tier: str) -> InferenceRequest:
    """The request with a request id filled in; InvalidArgument on the first bad field."""
    if req.messages is None:
        check_prompt(req.prompt)
    else:
        check_messages(req.messages)
    check_max_tokens(req.max_tokens, tier_cap, tier)
    check_sampling(req.sampling)
    check_stop(req.stop)
    check_top_logprobs(req.top_logprobs)
    if len(req.app) > MAX_APP_CHARS:
        raise InvalidArgument(f"app is {len(req.app)} characters; at most {MAX_APP_CHARS}")
    check_no_nul(req.app, "app")  # the meter refuses a usage record with one
    if req.request_id and not _REQUEST_ID_RE.match(req.request_id):
        raise InvalidArgument(
            "request_id must be 1-128 characters of letters, digits, '.', '_', ':' or '-'")
    if req.session_id and not _SESSION_ID_RE.match(req.session_id):
        raise InvalidArgument(f"{SESSION_HEADER} must be 1-{MAX_SESSION_ID_CHARS} printable"
                              " ASCII characters without spaces")
    return req if req.request_id else replace(req, request_id=uuid.uuid4().hex)


def check_context(prompt_tokens: int, max_tokens: int, max_context: int | None) -> None:
    """After tokenizing: the prompt and the completion must fit the model's context."""
    if max_context and prompt_tokens + max_tokens > max_context:
        raise InvalidArgument(
            f"prompt is {prompt_tokens} tokens and max_tokens is {max_tokens}; together they"
            f" must be <= the model's context of {max_context} tokens")
