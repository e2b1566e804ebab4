"""Protobuf <-> domain conversion of the engine servicer, and flag parsing."""
from __future__ import annotations

import pytest

from services.engine.engine_core import FinalStats, RequestOutput
from services.engine.interface import SampledToken, TopLogprob
from services.engine.main import parse_args
from services.engine.sequence import FinishReason
from services.engine.servicer import response_to_pb, sampling_from_pb
from tokenserve.common.v1 import common_pb2
from tokenserve.engine.v1 import engine_pb2 as pb


def test_unset_sampling_fields_take_the_defaults():
    s = sampling_from_pb(pb.GenerateRequest())
    assert s.greedy and s.top_p == 1.0 and s.repetition_penalty == 1.0 and s.seed is None
    assert not s.logprobs


def test_set_sampling_fields_are_kept_including_zero():
    req = pb.GenerateRequest(sampling=common_pb2.SamplingParams(
        temperature=0.5, top_p=0.0, top_k=7, seed=0), top_logprobs=2)
    s = sampling_from_pb(req)
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.5, 0.0, 7, 0)
    assert s.logprobs and s.top_logprobs == 2


def test_last_message_carries_reason_usage_timings_and_energy():
    out = RequestOutput(1, "r", token_ids=[5], text="hi",
                        logprobs=[SampledToken(5, -0.1, (TopLogprob(5, -0.1), TopLogprob(6, -2.0)))],
                        finish_reason=FinishReason.LENGTH,
                        final=FinalStats(3, 1, 0, 0.1, 0.2, 0.3, 1.5, True, 0))
    msg = response_to_pb(out)
    assert list(msg.token_ids) == [5] and msg.text == "hi"
    assert msg.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (msg.usage.prompt_tokens, msg.usage.completion_tokens) == (3, 1)
    assert msg.timings.total_seconds == pytest.approx(0.3)
    assert msg.energy_joules == pytest.approx(1.5) and msg.energy_estimated
    assert [t.token_id for t in msg.logprobs[0].top] == [5, 6]
    mid = response_to_pb(RequestOutput(1, "r", token_ids=[6], text="x"))
    assert not mid.HasField("usage") and mid.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED


def test_flags_build_a_validated_config(tmp_path):
    c = parse_args(["--model-path", str(tmp_path), "--port", "0", "--metrics-port", "-1",
                    "--etcd-endpoints", "a:1,b:2", "--kv-cache-mb", "8"])
    assert c.metrics_port is None and c.etcd_endpoints == ("a:1", "b:2") and c.kv_cache_mb == 8
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--block-size", "12"])


def test_the_default_is_the_fast_mode_and_exact_is_float32(tmp_path):
    c = parse_args(["--model-path", str(tmp_path)])
    assert c.quantization == "auto" and c.kv_cache_dtype is None  # the runner picks float16 KV
    assert c.prefill_dtype == "auto"  # bfloat16 prompt rows where the CPU has it natively
    e = parse_args(["--model-path", str(tmp_path), "--exact"])
    assert (e.quantization, e.dtype, e.kv_cache_dtype) == ("none", "float32", "float32")
    with pytest.raises(SystemExit):  # --exact cannot be combined with a lossy setting
        parse_args(["--model-path", str(tmp_path), "--exact", "--kv-cache-dtype", "float16"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--exact", "--prefill-dtype", "bfloat16"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--exact", "--prefill-dtype", "int8"])
    assert parse_args(["--model-path", str(tmp_path), "--prefill-dtype", "int8"]).prefill_dtype == "int8"
    with pytest.raises(SystemExit):  # 8-bit inputs are for prompt rows only
        parse_args(["--model-path", str(tmp_path), "--decode-dtype", "int8"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", str(tmp_path), "--prefill-dtype", "float16"])
