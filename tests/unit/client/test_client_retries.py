"""The SDK's retries before the first token (RetryPolicy, and both clients over a fake stub
method: pure logic, no server)."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.unit.client.test_client_mapping import FakeRpcError
from tokenserve import client as sdk
from tokenserve.client_errors import RateLimitError, RetryPolicy, UnavailableError
from tokenserve.gateway.v1 import gateway_pb2

UNAVAILABLE = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "no engine")
LIMITED = FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "10 requests/s",
                       (("retry-after-ms", "20"), ("limit", "rps")))
ONE = gateway_pb2.GenerateResponse(text="a", token_ids=[1])


def test_policy_honours_retry_after_and_its_caps():
    policy = RetryPolicy(max_retries=2, max_wait=1.0)
    limited = RateLimitError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", 0.5)
    assert policy.wait(limited, 1, time_left=10) == 0.5
    assert policy.wait(limited, 3, time_left=10) is None  # retries used up
    assert policy.wait(limited, 1, time_left=0.4) is None  # past the call's deadline
    too_long = RateLimitError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", 5.0)
    assert policy.wait(too_long, 1, time_left=10) is None  # longer than max_wait: raise now
    invalid = sdk.InvalidRequestError(grpc.StatusCode.INVALID_ARGUMENT, "x")
    assert policy.wait(invalid, 1, time_left=10) is None


def test_policy_backs_off_exponentially_with_jitter_without_retry_after():
    policy, rng = RetryPolicy(backoff=0.2), random.Random(1)
    err = UnavailableError(grpc.StatusCode.UNAVAILABLE, "x")
    waits = [policy.wait(err, n, time_left=60, rng=rng) for n in (1, 2, 3)]
    for n, w in enumerate(waits):
        assert 0.1 * 2 ** n <= w <= 0.2 * 2 ** n


class FakeMethod:
    """A stub method that fails with `errors` in turn, then streams `responses`."""

    def __init__(self, errors, responses=(ONE,), fail_after_first=False):
        self.errors, self.responses, self.calls = list(errors), responses, []
        self.fail_after_first = fail_after_first

    def _outcome(self, timeout):
        self.calls.append(timeout)
        return self.errors.pop(0) if self.errors else None

    def __call__(self, req, metadata, timeout):
        err = self._outcome(timeout)
        method = self

        class Call:
            def __iter__(self):
                if method.fail_after_first:
                    yield from method.responses
                    raise UNAVAILABLE
                if err is not None:
                    raise err
                yield from method.responses

            def __aiter__(self):
                return self._async()

            async def _async(self):
                for resp in self:
                    yield resp

            def __await__(self):
                async def unary():
                    if err is not None:
                        raise err
                    return gateway_pb2.ListModelsResponse()
                return unary().__await__()

            def cancel(self):
                pass

        return Call()


@pytest.fixture
def client():
    c = sdk.Client("127.0.0.1:1", "ts-test", timeout=10,
                   retry=RetryPolicy(max_retries=3, backoff=0.001))
    yield c
    c.close()


def test_stream_retries_refusals_before_the_first_token(client):
    method = FakeMethod([UNAVAILABLE, LIMITED])
    assert [c.text for c in client._stream(method, None)] == ["a"]
    assert len(method.calls) == 3
    assert method.calls[1] <= 10 and method.calls[2] < method.calls[1]  # one deadline in all


def test_stream_gives_up_after_max_retries_with_the_typed_error(client):
    method = FakeMethod([LIMITED] * 4)
    with pytest.raises(RateLimitError) as err:
        list(client._stream(method, None))
    assert (err.value.limit, err.value.retry_after) == ("rps", 0.02)
    assert len(method.calls) == 4


def test_no_retry_once_a_token_was_streamed(client):
    method = FakeMethod([], fail_after_first=True)
    got = []
    with pytest.raises(UnavailableError):
        for chunk in client._stream(method, None):
            got.append(chunk.text)
    assert got == ["a"] and len(method.calls) == 1


def test_async_client_retries_streams_and_unary_calls():
    async def run():
        async with sdk.AsyncClient("127.0.0.1:1", "ts-test",
                                   retry=RetryPolicy(backoff=0.001)) as c:
            method = FakeMethod([UNAVAILABLE])
            assert [ch.text async for ch in c._stream(method, None)] == ["a"]
            unary = FakeMethod([LIMITED, UNAVAILABLE])
            await c._unary(unary, None)
            return len(method.calls), len(unary.calls)

    assert asyncio.run(run()) == (2, 3)


def test_key_and_gateway_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("TOKENSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match="TOKENSERVE_API_KEY"):
        sdk.Client()
    monkeypatch.setenv("TOKENSERVE_API_KEY", "ts-env")
    monkeypatch.setenv("TOKENSERVE_GATEWAY", "127.0.0.1:2")
    with sdk.Client() as c:
        assert c._metadata == (("authorization", "Bearer ts-env"),)
