"""The Python SDK (sync and asyncio) against the real gateway process, whose tokenizer and
engine are the FAKE servers of fakes.py."""
from __future__ import annotations

import asyncio

import pytest

from tests.integration.gateway.conftest import FREE_MAX_TOKENS
from tests.integration.gateway.fakes import MODEL
from tokenserve.client import (AsyncClient, AuthenticationError, Client, InvalidRequestError,
                               NotFoundError)


def test_sync_client_streams_and_collects(gateway, key):
    with Client(gateway.target, key, timeout=20) as c:
        chunks = list(c.generate("a b c", max_tokens=3, temperature=0.0, request_id="sdk-1"))
        assert [ch.text for ch in chunks] == ["w0 ", "w1 ", "w2 "]
        assert chunks[0].request_id == chunks[-1].request_id == "sdk-1"
        assert chunks[-1].finish_reason == "length"
        text, usage = c.chat_text([{"role": "user", "content": "hello"}], max_tokens=2)
        assert text == "w0 w1 " and (usage.prompt_tokens, usage.completion_tokens) == (4, 2)
        assert c.count_tokens("one two") == 2
        assert c.count_tokens(messages=[("user", "one two")]) == 5
        models = {m.name: m for m in c.list_models()}
        assert models[MODEL].versions == {"v1": 1} and models[MODEL].max_context == 64


def test_sync_client_errors_are_readable(gateway, key):
    with Client(gateway.target, key, timeout=20) as c:
        with pytest.raises(InvalidRequestError, match=f"at most {FREE_MAX_TOKENS}") as err:
            c.generate_text("hi", max_tokens=FREE_MAX_TOKENS + 1)
        assert err.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(NotFoundError, match=MODEL):
            c.generate_text("hi", model="nope", max_tokens=1)
    with Client(gateway.target, "ts-wrong", timeout=20) as c:
        with pytest.raises(AuthenticationError):
            c.list_models()


def test_leaving_a_stream_early_cancels_the_request(gateway, key, engine):
    engine.servicer.cancel_seen.clear()
    # slow tokens, so the fake cannot finish all of them before the cancel reaches it
    engine.servicer.delay, delay = 0.5, engine.servicer.delay
    try:
        with Client(gateway.target, key, timeout=30) as c:
            stream = c.generate("a", max_tokens=FREE_MAX_TOKENS, request_id="sdk-leave")
            next(stream)
            stream.close()
        assert engine.servicer.cancel_seen.wait(10)
    finally:
        engine.servicer.delay = delay
    assert "sdk-leave" in engine.servicer.cancelled


def test_async_client(gateway, key):
    async def run():
        async with AsyncClient(gateway.target, key, timeout=20) as c:
            text, usage = await c.generate_text("x y", max_tokens=2)
            chunks = [ch async for ch in c.chat([("user", "hi")], max_tokens=1)]
            n = await c.count_tokens("a b c")
            with pytest.raises(InvalidRequestError, match="prompt"):
                await c.generate_text("", max_tokens=1)
            return text, usage, chunks, n

    text, usage, chunks, n = asyncio.run(run())
    assert text == "w0 w1 " and usage.completion_tokens == 2
    assert chunks[-1].finish_reason == "length" and n == 3
