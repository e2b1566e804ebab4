"""The device-side sampling and runner path makes one host synchronisation per step.

On CUDA a host wait hides in `.tolist()`, `.item()`, `bool(tensor)`, `.cpu()`, a boolean-mask
index, or a copy from pageable memory; the code moves data only through
services.engine.device (to_device: pinned, asynchronous; HostCopy / to_host: one wait). These tests run
the same code on CPU tensors with every implicit transfer counted, and check the math of the
device path against a row-by-row reference."""
from __future__ import annotations

import contextlib

import pytest
import torch

from services.engine import device, runner as runner_mod, sampler as sampler_mod
from services.engine.interface import Batch, SamplingParams, SeqChunk
from services.engine.runner import ModelRunner
from services.engine.sampler import Sampler, sample_rows
from tests.unit.engine import tiny_models as tm

_IMPLICIT = ("tolist", "item", "__bool__", "cpu", "numpy", "nonzero")


@contextlib.contextmanager
def counting(monkeypatch):
    """Counts host waits (device.HostCopy.wait, which to_host is too) and tensor -> host
    conversions made outside them."""
    counts = {"waits": 0, "implicit": []}
    inside = [False]

    def wrap(name, original):
        def f(self, *a, **k):
            if not inside[0]:
                counts["implicit"].append(name)
            return original(self, *a, **k)
        return f

    for name in _IMPLICIT:
        monkeypatch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    real = device.HostCopy.wait

    def wait(self):
        counts["waits"] += 1
        inside[0] = True
        try:
            return real(self)
        finally:
            inside[0] = False

    monkeypatch.setattr(device.HostCopy, "wait", wait)
    yield counts


def chunk(seq_id, output=(), **kw):
    return SeqChunk(seq_id, [1], 3, [0], True, SamplingParams(**kw), prompt_token_ids=[1, 2, 3],
                    output_token_ids=list(output))


MIXED = [dict(), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.7, seed=4),
         dict(temperature=0.6, min_p=0.1, top_k=20, repetition_penalty=1.3),
         dict(logprobs=True, top_logprobs=3), dict(temperature=1.2, top_k=3, top_p=0.9,
                                                   frequency_penalty=0.5, logprobs=True)]


def test_sampling_a_mixed_batch_reads_the_device_once(monkeypatch):
    logits = torch.randn(len(MIXED), 40, generator=torch.Generator().manual_seed(2))
    chunks = [chunk(i, output=[5, 5, 7], **p) for i, p in enumerate(MIXED)]
    with counting(monkeypatch) as counts:
        out = Sampler(seed=1).sample(logits, chunks)
    assert counts["waits"] == 1 and counts["implicit"] == []
    assert len(out) == len(MIXED) and len(out[4].top) == 3 and out[5].logprob is not None


def test_device_path_math_equals_row_by_row_sampling():
    """Batched on the device == each row alone with the same uniform draws (seeded rows
    draw from their own generator, as on the CPU: speculation's rewind relies on it). Every
    sampled row here sorts (top-k / top-p), as a batch does when any of its rows does."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(len(MIXED), 40, generator=g)
    chunks = [chunk(i, **p) for i, p in enumerate(MIXED)]
    batched = [t.token_id for t in Sampler(seed=3).sample(logits, chunks)]
    shared = torch.Generator().manual_seed(3)
    own = {4: torch.Generator().manual_seed(4)}
    expect = []
    for i, c in enumerate(chunks):
        p = c.sampling
        row = sampler_mod.apply_penalties(logits[i:i + 1], [c])
        if p.greedy:
            expect.append(int(row.argmax()))
            continue
        u = torch.rand(1, generator=own.get(p.seed, shared))
        expect.append(int(sample_rows(row, [p], u)[0]))
    assert batched == expect


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    path = tm.write_gguf(tmp_path_factory.mktemp("m") / "m.gguf", tm.random_weights(2))
    return ModelRunner(path, num_blocks=16, block_size=4, num_threads=1, seed=0)


def test_a_runner_step_reads_the_device_once(tiny_runner, monkeypatch):
    """A step mixing a prompt chunk, plain decodes and a sampled row, no hidden transfers."""
    r = tiny_runner
    g = SamplingParams()
    r.execute(Batch([SeqChunk(1, [3, 4, 5], 0, [0], True, g),
                     SeqChunk(2, [6, 7], 0, [1], True, g)]))
    calls = []
    real_tensor = torch.tensor

    def tensor(*a, **k):  # every host -> device copy goes through device.to_device
        calls.append(k.get("device"))
        return real_tensor(*a, **k)

    monkeypatch.setattr(runner_mod.torch, "tensor", tensor)
    with counting(monkeypatch) as counts:
        out = r.execute(Batch([SeqChunk(3, [8, 9, 10, 11], 0, [2, 3], True, g),
                               SeqChunk(1, [7], 3, [0], True, g),
                               SeqChunk(2, [9], 2, [1], True, SamplingParams(temperature=0.7))]))
    assert set(out.sampled) == {1, 2, 3}
    assert counts["waits"] == 1 and counts["implicit"] == []
    assert calls and all(d in (None, "cpu") or str(d) == "cpu" for d in calls)
    r.execute(Batch([], finished_seq_ids=[1, 2, 3]))


def test_submit_queues_a_step_without_waiting_and_result_waits_once(tiny_runner, monkeypatch):
    """The overlapped step loop works on the host between submit and result: submit must
    not wait for the device (a speculative chunk included: its rewind happens in result)."""
    r = tiny_runner
    g = SamplingParams()
    r.execute(Batch([SeqChunk(4, [3, 4, 5, 6], 0, [4], True, g)]))
    with counting(monkeypatch) as counts:
        pending = r.submit(Batch([SeqChunk(4, [6, 2, 2], 3, [4, 5], True,
                                           SamplingParams(temperature=0.9, seed=3),
                                           num_draft_tokens=2),
                                  SeqChunk(5, [8, 9], 0, [6], True, g)]))
        assert counts["waits"] == 0 and counts["implicit"] == []
        out = pending.result()
    assert counts["waits"] == 1 and counts["implicit"] == []
    assert set(out.sampled) == {4, 5} and 4 in out.accepted
    r.execute(Batch([], finished_seq_ids=[4, 5]))
