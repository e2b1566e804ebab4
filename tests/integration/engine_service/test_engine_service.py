"""The engine service as a real process with the real model, over gRPC on loopback."""
from __future__ import annotations

import asyncio
import random
import urllib.request

import grpc
import pytest

from controlplane.service_process import NOT_SERVING, SERVING
from tests.integration.engine_service.conftest import engine_process
from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2 as pb
from tokenserve.engine.v1 import engine_pb2_grpc
from tokenserve.models import default_model_path
from tokenserve.runtime.ports import free_port
from tokenserve.tokenization import load_model_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def metrics_port():
    return free_port()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, metrics_port):
    # float32 prefill: the suite checks that a request's tokens do not depend on its batch,
    # which bfloat16 prompt rows (the default where the CPU has native bfloat16) do not promise
    proc = engine_process(tmp_path_factory.mktemp("engine") / "engine.log",
                          "--prefill-dtype", "float32", metrics_port=metrics_port).spawn()
    try:
        yield proc.wait_serving(timeout=600)
    finally:
        proc.stop(grace=60)


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_tokenizer(default_model_path())


@pytest.fixture
async def stub(engine):
    async with grpc.aio.insecure_channel(engine.target) as ch:
        yield engine_pb2_grpc.EngineServiceStub(ch)


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)


async def generate(stub, **fields) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(pb.GenerateRequest(**fields), timeout=600)]


async def wait_idle(stub) -> pb.GetInfoResponse:
    for _ in range(600):
        info = await stub.GetInfo(pb.GetInfoRequest())
        if info.running == 0 and info.waiting == 0 and info.kv_blocks_free == info.kv_blocks_total:
            return info
        await asyncio.sleep(0.05)
    return info


def test_health_was_not_serving_until_the_model_loaded(engine):
    assert engine.statuses[0] == NOT_SERVING and engine.statuses[-1] == SERVING


async def test_get_info_reports_model_and_kv_geometry(stub):
    info = await stub.GetInfo(pb.GetInfoRequest())
    assert info.model == "smollm2-135m-instruct" and info.version == "q4_1"
    assert info.vocab_size == 49152 and info.device == "cpu" and info.dtype == "float32"
    assert info.kv_block_size == 16 and info.kv_blocks_total > 0
    assert 0 < info.max_context <= info.kv_blocks_total * 16
    assert info.max_concurrency == 16


async def test_streams_tokens_and_text_with_usage_on_the_last_message(stub, tokenizer):
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    msgs = await generate(stub, request_id="it-1", prompt_token_ids=prompt, max_tokens=24)
    ids = [t for m in msgs for t in m.token_ids]
    text = "".join(m.text for m in msgs)
    last = msgs[-1]
    assert len(msgs) >= 2
    assert all(not m.HasField("usage") for m in msgs[:-1])
    assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert last.usage.prompt_tokens == len(prompt) and last.usage.completion_tokens == len(ids)
    assert text == tokenizer.decode(ids)
    assert "Paris" in text
    t = last.timings
    assert 0 <= t.queue_seconds <= t.time_to_first_token_seconds <= t.total_seconds
    assert last.energy_joules > 0 and last.energy_estimated


async def test_batched_results_equal_unbatched_for_32_requests(stub):
    rng = random.Random(3)
    reqs = [dict(request_id=f"b{i}", max_tokens=rng.randint(2, 6), ignore_eos=True,
                 prompt_token_ids=[rng.randrange(100, 40000) for _ in range(rng.randint(2, 40))])
            for i in range(32)]
    alone = [[t for m in await generate(stub, **r) for t in m.token_ids] for r in reqs]
    together = await asyncio.gather(*(generate(stub, **r) for r in reqs))
    for r, solo, msgs in zip(reqs, alone, together):
        assert len(solo) == r["max_tokens"]
        assert [t for m in msgs for t in m.token_ids] == solo, r["request_id"]


async def test_repeated_prompt_is_served_from_the_prefix_cache(stub, tokenizer):
    prompt = chat_ids(tokenizer, "Write one sentence about the sea. " * 6)
    first = await generate(stub, prompt_token_ids=prompt, max_tokens=4)
    second = await generate(stub, prompt_token_ids=prompt, max_tokens=4)
    # at most the block of the chat template's system prompt, which earlier tests' prompts share
    # (a float16 KV cache holds enough blocks that theirs are still cached)
    assert first[-1].usage.cached_tokens <= 16
    assert second[-1].usage.cached_tokens >= (len(prompt) - 1) // 16 * 16 - 16
    assert second[-1].usage.cached_tokens > 0
    assert [t for m in first for t in m.token_ids] == [t for m in second for t in m.token_ids]


async def test_stop_string_ends_the_stream_and_is_not_returned(stub, tokenizer):
    prompt = chat_ids(tokenizer, "Count from one to twenty in words, separated by commas.")
    free = "".join(m.text for m in await generate(stub, prompt_token_ids=prompt, max_tokens=30))
    stop = free[len(free) // 2:len(free) // 2 + 4]
    assert stop.strip()
    msgs = await generate(stub, prompt_token_ids=prompt, max_tokens=30, stop=[stop])
    text = "".join(m.text for m in msgs)
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert stop not in text and free.startswith(text) and len(text) >= free.find(stop)


async def test_stop_token_ids_and_logprobs(stub, tokenizer):
    prompt = chat_ids(tokenizer, "Say hello.")
    free = [t for m in await generate(stub, prompt_token_ids=prompt, max_tokens=6, ignore_eos=True)
            for t in m.token_ids]
    msgs = await generate(stub, prompt_token_ids=prompt, max_tokens=6, stop_token_ids=[free[2]],
                          top_logprobs=3)
    ids = [t for m in msgs for t in m.token_ids]
    assert ids == free[:free.index(free[2]) + 1]
    assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token_id for lp in lps] == ids
    assert all(len(lp.top) == 3 and lp.logprob <= 0 for lp in lps)
    assert lps[0].top[0].token_id == ids[0]  # greedy: the top alternative is the token


async def test_cancelled_streams_free_their_blocks(stub):
    info = await wait_idle(stub)
    total = info.kv_blocks_total
    calls = [stub.Generate(pb.GenerateRequest(prompt_token_ids=list(range(200, 200 + 20 * (i + 1))),
                                              max_tokens=300, ignore_eos=True)) for i in range(6)]
    for i, call in enumerate(calls):
        for _ in range(i % 3 + 1):
            await call.read()
    busy = await stub.GetInfo(pb.GetInfoRequest())
    assert busy.kv_blocks_free < total and busy.running > 0
    for call in calls:
        call.cancel()
    info = await wait_idle(stub)
    assert info.kv_blocks_free == total and info.running == 0


async def test_deadline_expiry_aborts_the_request(stub):
    await wait_idle(stub)
    # no speculation and far more tokens than any CPU decodes in the deadline: a repetitive
    # greedy output with drafts on can yield 8 tokens a step and finish 600 tokens in 1.5 s
    call = stub.Generate(pb.GenerateRequest(prompt_token_ids=[300, 301, 302], max_tokens=1400,
                                            ignore_eos=True, speculation=False), timeout=1.0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = await wait_idle(stub)
    assert info.kv_blocks_free == info.kv_blocks_total


@pytest.mark.parametrize("fields, words", [
    (dict(prompt_token_ids=[], max_tokens=4), "prompt_token_ids must not be empty"),
    (dict(prompt_token_ids=[1, 49152], max_tokens=4), "prompt_token_ids[1] = 49152"),
    (dict(prompt_token_ids=[1], max_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt_token_ids=[1], max_tokens=10**6), "max_tokens may be at most"),
    (dict(prompt_token_ids=[1] * 20000, max_tokens=1), "at most"),
    (dict(prompt_token_ids=[1], max_tokens=4, top_logprobs=21), "top_logprobs"),
    (dict(prompt_token_ids=[1], max_tokens=4,
          sampling=common_pb2.SamplingParams(temperature=-1)), "temperature"),
    (dict(prompt_token_ids=[1], max_tokens=4,
          sampling=common_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
    (dict(prompt_token_ids=[1], max_tokens=4, sampling=common_pb2.SamplingParams(top_p=0)), "top_p"),
    (dict(prompt_token_ids=[1], max_tokens=4, sampling=common_pb2.SamplingParams(top_k=-2)), "top_k"),
    (dict(prompt_token_ids=[1], max_tokens=4, sampling=common_pb2.SamplingParams(min_p=2)), "min_p"),
    (dict(prompt_token_ids=[1], max_tokens=4,
          sampling=common_pb2.SamplingParams(presence_penalty=3)), "presence_penalty"),
])
async def test_bad_inputs_are_invalid_argument(stub, fields, words):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(stub, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details()


async def test_metrics_endpoint_exports_engine_metrics(stub, metrics_port):
    await generate(stub, prompt_token_ids=[400, 401, 402], max_tokens=3)
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    for name in ("tokenserve_engine_time_to_first_token_seconds_count",
                 "tokenserve_engine_inter_token_latency_seconds_count",
                 "tokenserve_engine_queue_seconds_count", "tokenserve_engine_kv_blocks_free",
                 "tokenserve_engine_generated_tokens_total", "tokenserve_engine_preemptions_total",
                 "tokenserve_engine_prefix_cache_hit_rate", "tokenserve_engine_running_requests"):
        assert name in body


def _metric(metrics_port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                  timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + " "))


async def test_speculation_opt_out_changes_speed_not_output(metrics_port, stub, tokenizer):
    """A code edit repeats its prompt: drafts are proposed and accepted, and the tokens and
    usage equal those of the same request with speculation off (which drafts nothing)."""
    code = "\n".join(f"    total_{i} = compute(values[{i}], scale={i})" for i in range(12))
    prompt = tokenizer.encode(f"def totals(values):\n{code}\n\n\ndef totals_again(values):\n"
                              "    total_0 = compute(values[0], scale=0)\n    total_1 =")
    proposed = "tokenserve_engine_draft_tokens_proposed_total"
    accepted = "tokenserve_engine_draft_tokens_accepted_total"
    before = _metric(metrics_port, proposed), _metric(metrics_port, accepted)
    off = await generate(stub, prompt_token_ids=prompt, max_tokens=48, speculation=False)
    assert (_metric(metrics_port, proposed), _metric(metrics_port, accepted)) == before
    on = await generate(stub, prompt_token_ids=prompt, max_tokens=48)
    assert _metric(metrics_port, accepted) > before[1]
    assert [t for m in on for t in m.token_ids] == [t for m in off for t in m.token_ids]
    assert "".join(m.text for m in on) == "".join(m.text for m in off)
    assert on[-1].usage.completion_tokens == off[-1].usage.completion_tokens
    assert len(on) < len(off)  # several tokens per message: fewer steps
