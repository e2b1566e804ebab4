"""The GPU suite's step-loop section: the engine's own step thread (EngineLoop over EngineCore,
scheduler and runner, as a served engine runs them) decoding concurrent greedy streams, with
the host's work overlapped with the device's (the CUDA default) and without (`--eager`'s
order), alternating, same prompts. Reports aggregate tokens/s of each, their ratio, and
whether every stream got the same tokens both ways. Called by bench/gpu_suite.py.
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

from bench import gpu_models
from services.engine.block_manager import BlockManager
from services.engine.engine_core import EngineCore
from services.engine.engine_loop import EngineLoop
from services.engine.interface import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import Sequence, StopCriteria


def stream_all(runner, prompts: list[list[int]], new: int, overlap: bool) -> tuple[float, list]:
    """Every prompt as a request to a fresh step thread at once; returns (seconds from the
    submits to the last final output, each request's tokens)."""
    n = len(prompts)
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_model_len=runner.max_context,
                                      max_num_batched_tokens=max(256, sum(map(len, prompts)))),
                      BlockManager(runner.num_blocks, runner.block_size),
                      set(runner.eos_token_ids))
    core = EngineCore(runner, sched, overlap=overlap)
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    left = [n]
    done = threading.Event()

    def deliver(outputs):  # on the step thread
        for o in outputs:
            tokens[o.seq_id].extend(o.token_ids)
            if o.final is not None:
                left[0] -= 1
        if left[0] == 0:
            done.set()

    loop = EngineLoop(lambda: core, deliver)
    loop.start()
    loop.ready.wait()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        loop.submit(Sequence(i, f"r{i}", p, SamplingParams(),
                             StopCriteria(max_tokens=new, ignore_eos=True)))
    done.wait(600)
    seconds = time.perf_counter() - t0
    loop.stop()
    if core.scheduler.blocks.num_free_blocks != runner.num_blocks:
        raise RuntimeError("KV blocks not all free after the streams ended")
    return seconds, [tokens[i] for i in range(n)]


def run_step_loop(device: str, model_name: str, streams: int, prompt: int, new: int,
                  rounds: int, gguf=None) -> dict:
    from bench.gpu_suite import make_runner, random_prompts

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = gpu_models.load(model_name, device, dtype, gguf)
    runner = make_runner(model, device, streams, prompt + new + 16)
    prompts = random_prompts(model.loaded.config.vocab_size, streams, prompt, seed=7)
    stream_all(runner, prompts, 4, True)  # warm-up
    times = {False: [], True: []}
    outputs = {}
    for r in range(rounds):
        for overlap in ((False, True) if r % 2 == 0 else (True, False)):
            s, out = stream_all(runner, prompts, new, overlap)
            times[overlap].append(s)
            outputs.setdefault(overlap, out)
    total = streams * new

    def row(ts):
        med = statistics.median(ts)
        return {"seconds": ts, "median_s": med, "tok_s": total / med}

    plain, overlapped = row(times[False]), row(times[True])
    return {"model": model_name, "streams": streams, "prompt_tokens": prompt, "new_tokens": new,
            "rounds": rounds, "asynchronous_runner": runner.asynchronous,
            "plain": plain, "overlapped": overlapped,
            "overlap_speedup": overlapped["tok_s"] / plain["tok_s"],
            "outputs_equal": outputs[False] == outputs[True]}
