"""ModelRunner: the engine core's only door to torch.

    runner = ModelRunner(path, dtype="float32", quantization="none", block_size=16)
    out = runner.execute(batch)   # computes KV for every chunk, samples where chunk.sample

Call it from one dedicated thread (torch's OpenMP team is bound to the calling thread).
The KV cache is paged: per layer K and V are [num_blocks, block_size, n_kv_heads, head_dim];
the scheduler owns block allocation and hands each chunk its block_table.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Callable

import torch

from services.engine import cpu_kernels
from services.engine.attention import (BLOCKED_PROMPT_MAX_CTX, PAGED_PROMPT_MAX_CTX, KVCache, build_metadata,
                                       kernel_fits)
from services.engine.config import resolve_dtype
from services.engine.cuda_graphs import DecodeGraphs, graph_buckets
from services.engine.device import to_device
from services.engine.interface import Batch, RunnerOutput, SeqChunk
from services.engine.loader import LoadedWeights, ModelLoadError, load_weights
from services.engine.model import LlamaModel
from services.engine.quant import (QUANTIZATIONS, decode_in_bfloat16, decode_in_int16, prefill_in_bfloat16,
                                   prefill_in_int16, prefill_in_int8)
from services.engine.sampler import PendingTokens, Sampler
from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Auto-sized KV cache on the CPU: this share of available RAM, at most this many bytes.
_CPU_KV_FRACTION = 0.25
_CPU_KV_CAP_BYTES = 2 << 30
_GPU_KV_FRACTION = 0.8


class ModelRunner:
    """Loads the model once and runs steps.

    Attributes the engine core reads: block_size, num_blocks, max_context, vocab_size,
    eos_token_ids, device, dtype, quantization, model_name, load_seconds, asynchronous
    (True on CUDA: `submit` returns while the device still works, so the step loop can
    overlap its host work with the step; on the CPU the step is computed inside `submit`).
    Raises ModelLoadError (path + reason) when the model cannot be served.
    quantization: "none" (the default here: dense weights in dtype; float32 is the bit-faithful
    exact mode), "auto" (the service's default: the GGUF file's own blocks, int8 for the rest;
    see quant.py) or "int8".
    dtype: "float32", "bfloat16", "float16" or "auto" (config.resolve_dtype: bfloat16 on CUDA,
    float32 on the CPU).
    kv_cache_dtype: what K/V are stored as (default on the CPU: float16 when quantized, else
    dtype; on CUDA: dtype); float16 halves the cache's memory and the bytes decode attention
    reads, at ~1e-3 relative rounding of K/V.
    prefill_dtype: "auto" (bfloat16 for prompt rows where the CPU multiplies it natively, else
    int16 where its integer multiplies are the faster), "bfloat16", "float32", "int16" or
    "int8" (opt-in: the 4-bit blocks' prompt rows but q/k/v with the input rounded to int8);
    only GGUF blocks served by their kernels (quantization "auto") keep a bfloat16 copy for
    prompt rows (see quant.py).
    decode_dtype: "auto" (bfloat16 arithmetic on the GGUF blocks where their kernels have an
    AVX512-BF16 build for this CPU, else "int16"), "bfloat16", "int16" (decode rows' input in
    16-bit fixed point per block of 32, the blocks' products summed in integers; prompt rows
    float32) or "float32": the rows the blocks' kernel multiplies (decodes, drafts, short
    prompt chunks); quantization "auto" only.
    kernels=False turns off the AVX2 C kernels (fused norm, int8 matmul): torch ops only.
    num_threads: torch intra-op threads (default: the CPUs this process may use).
    seed: seeds the generator of unseeded sampling requests (tests).
    cuda_graphs: on CUDA, replay decode-only steps from CUDA graphs (cuda_graphs.py; False is
    --eager); never attempted on the CPU. decode_attention: model.DECODE_ATTENTION (CUDA).
    model_path may also be LoadedWeights already in memory (benchmarks with random weights).
    """

    def __init__(self, model_path: str | Path, *, device: str = "cpu", dtype: str = "float32",
                 quantization: str = "none", kv_cache_dtype: str | None = None,
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, max_num_seqs: int = 64,
                 progress: Callable[[int, int], None] | None = None,
                 num_threads: int | None = None, seed: int | None = None, kernels: bool = True,
                 prefill_dtype: str = "auto", decode_dtype: str = "auto", cuda_graphs: bool = True,
                 decode_attention: str = "auto"):
        if dtype == "auto":
            dtype = resolve_dtype(dtype, device)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        on_cuda = device.split(":")[0] == "cuda"
        # the CPU's fast modes store K/V in float16 (half the memory and decode reads); exact
        # mode and CUDA (bfloat16 compute): dtype
        kv_cache_dtype = kv_cache_dtype or (
            "float16" if quantization != "none" and not on_cuda else dtype)
        if kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(DTYPES)}, got {kv_cache_dtype!r}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        prefill_bf16 = quantization == "auto" and prefill_in_bfloat16(prefill_dtype, device)
        decode_bf16 = (quantization == "auto" and kernels
                       and decode_in_bfloat16(decode_dtype, device))
        decode_i16 = (quantization == "auto" and kernels and not decode_bf16
                      and decode_in_int16(decode_dtype, device))
        prefill_i16 = (quantization == "auto" and kernels and not prefill_bf16
                       and prefill_in_int16(prefill_dtype, device, decode_i16))
        prefill_i8 = prefill_i16 and prefill_in_int8(prefill_dtype, device)
        if device == "cpu":
            torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        if on_cuda:  # graph capture and replay, Triton launches: all on the engine's device
            torch.cuda.set_device(torch.device(device))
        t0 = time.perf_counter()
        if isinstance(model_path, LoadedWeights):
            loaded, model_path = model_path, model_path.config.name
        else:
            loaded = load_weights(model_path, progress, keep_blocks=quantization == "auto")
        c = loaded.config
        try:
            with torch.inference_mode():
                self.model = LlamaModel(loaded, dtype=DTYPES[dtype], quantization=quantization,
                                        device=device, fused_kernels=kernels,
                                        prefill_bf16=prefill_bf16, decode_bf16=decode_bf16,
                                        decode_i16=decode_i16, prefill_i16=prefill_i16, prefill_i8=prefill_i8,
                                        decode_attention=decode_attention)
        except ValueError as e:  # e.g. an unsupported rope scaling
            raise ModelLoadError(model_path, str(e)) from e
        del loaded

        self.device, self.dtype, self.quantization = device, dtype, quantization
        self.asynchronous = on_cuda
        self.kv_cache_dtype = kv_cache_dtype
        # what the GGUF blocks' prompt and decode rows are multiplied in (quantization "auto")
        self.block_arithmetic = {
            "prefill": ("bfloat16" if prefill_bf16 else "int8" if prefill_i8 else "int16" if prefill_i16
                        else "float32"),
            "decode": "bfloat16" if decode_bf16 else "int16" if decode_i16 else "float32"}
        self.block_size = block_size
        self.vocab_size = c.vocab_size
        self.eos_token_ids = tuple(c.eos_token_ids)
        self.model_name = c.name
        self.config = c
        kv_dtype = DTYPES[kv_cache_dtype]
        per_block = KVCache.bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, kv_dtype)
        self.num_blocks = num_blocks or self._auto_blocks(per_block, kv_cache_bytes, max_num_seqs, c.max_position)
        if self.num_blocks < 1:
            raise ValueError(f"KV cache too small: kv_cache_bytes must allow one block of {per_block} bytes")
        graphs = on_cuda and cuda_graphs and self.model.decode_attention == "triton"
        # CUDA graphs: one more block, beyond those the scheduler may hand out, for padded rows
        self.kv = KVCache(c.num_layers, self.num_blocks + (1 if graphs else 0), block_size, c.num_kv_heads,
                          c.head_dim, kv_dtype, device)
        # short prompt chunks attend through the CPU kernels (attention.paged_prompts)
        self._paged_prompts = kernel_fits(self.model.cpu_kernels, c.head_dim, kv_dtype)
        self._paged_max_ctx = (BLOCKED_PROMPT_MAX_CTX if cpu_kernels.prompt_attention_fits(
            self.model.cpu_kernels, c.num_heads, c.num_kv_heads, c.head_dim, kv_dtype) else PAGED_PROMPT_MAX_CTX)
        self.max_context = min(c.max_position, self.num_blocks * block_size)
        self.sampler = Sampler(device, seed, kernels=kernels)
        self.graphs: DecodeGraphs | None = None
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.kv, buckets=graph_buckets(max_num_seqs),
                                       block_size=block_size, max_context=self.max_context,
                                       scratch_block=self.num_blocks, device=device)
            self.graphs.capture()
        elif on_cuda and cuda_graphs:
            log.warning("cuda_graphs_off", reason="no paged decode kernel (triton did not import)")
        # decode rows the layers multiply as one unit (16 on AMX tiles; 0: each row its own)
        self.decode_row_tile = getattr(self.model.layers[0].qkv, "decode_row_tile", 0)
        self._greedy_head = bool(getattr(self.model, "greedy_head", False))
        self.load_seconds = time.perf_counter() - t0
        log.info("runner_ready", model=self.model_name, dtype=dtype, quantization=quantization,
                 decode_row_tile=self.decode_row_tile,
                 kv_cache_dtype=kv_cache_dtype, prefill_bfloat16=prefill_bf16,
                 decode_bfloat16=decode_bf16, decode_int16=decode_i16, prefill_int16=prefill_i16, prefill_int8=prefill_i8,
                 num_blocks=self.num_blocks, block_size=block_size, max_context=self.max_context,
                 kv_cache_mib=round(self.num_blocks * per_block / 2**20, 1),
                 decode_attention=self.model.decode_attention,
                 cuda_graph_buckets=list(self.graphs.buckets) if self.graphs else None,
                 load_seconds=round(self.load_seconds, 2), threads=torch.get_num_threads())

    def _auto_blocks(self, per_block: int, kv_bytes: int | None, max_num_seqs: int, max_pos: int) -> int:
        if kv_bytes is None:
            if self.device.startswith("cuda"):
                free, _ = torch.cuda.mem_get_info(torch.device(self.device))
                kv_bytes = int(free * _GPU_KV_FRACTION)
            else:
                kv_bytes = min(int(_available_ram() * _CPU_KV_FRACTION), _CPU_KV_CAP_BYTES)
            # Never more than every sequence at full context would use.
            kv_bytes = min(kv_bytes, max_num_seqs * max_pos // self.block_size * per_block)
        return kv_bytes // per_block

    def execute(self, batch: Batch) -> RunnerOutput:
        """Compute KV for every chunk; sample one token for each chunk with sample=True.

        Chunks may mix prefills (any length, start_pos > 0 allowed), decodes (one token) and
        speculative decodes (one token plus drafts: sampled at every position, drafts kept
        while they equal what was sampled). Returns RunnerOutput.sampled (and .accepted)
        keyed by seq_id.
        """
        return self.submit(batch).result()

    @torch.inference_mode()
    def submit(self, batch: Batch,
               between_layers: Callable[[int, int], None] | None = None) -> "PendingStep":
        """`execute` in two halves: queues the step's device work and returns at once (on
        CUDA, before the device is done; `asynchronous`); `result()` waits for it.
        between_layers(done, num_layers): on the CPU, called between the model's layers
        (the engine may compute another step there); the step's reported seconds leave out
        the time spent in it."""
        t0 = time.perf_counter()
        inside = [0.0]  # seconds spent in between_layers

        def timed(done: int, total: int) -> None:
            t = time.perf_counter()
            between_layers(done, total)
            inside[0] += time.perf_counter() - t

        hook = timed if between_layers is not None and not self.asynchronous else None
        self.sampler.forget(batch.finished_seq_ids)
        if not batch.chunks:
            return PendingStep(self.sampler, [], None, {}, t0)
        # prefills first, then decodes (attention handles each group its own way)
        chunks = sorted(batch.chunks, key=_is_decode)
        ids: list[int] = []
        positions: list[int] = []
        spans = []
        rows: list[int] = []
        sample_chunks: list[SeqChunk] = []  # one per logits row
        for c in chunks:
            self._check(c)
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + n))
            spans.append((c.start_pos, n, c.block_table, _is_decode(c)))
            if c.sample:
                k = c.num_draft_tokens
                rows.extend(range(len(ids) - 1 - k, len(ids)))
                sample_chunks.extend(_draft_rows(c) if k else [c])
        dev = self.device
        greedy = False  # whether `out` holds the rows' argmax tokens rather than their logits
        if self.graphs is not None and self.graphs.fits(chunks):
            out = self.graphs.run(chunks)  # [len(chunks), V]: one row per decode chunk
            if len(rows) < len(chunks):  # a 1-token chunk that samples nothing
                out = out[to_device(rows, torch.long, dev)]
        else:
            # every row plain greedy: the lm_head gives the argmax tokens without the logits
            # where it can (model.greedy_head; the same tokens)
            greedy = bool(sample_chunks) and self._greedy_head and all(
                c.sampling.greedy and not c.sampling.penalized and not c.sampling.logprobs
                for c in sample_chunks)
            meta = build_metadata(spans, self.block_size, dev, self._paged_prompts, self._paged_max_ctx)
            out = self.model.forward(to_device(ids, torch.long, dev), to_device(positions, torch.long, dev),
                                     meta, self.kv, to_device(rows, torch.long, dev), hook, greedy)
        t0 += inside[0]
        if not sample_chunks:
            return PendingStep(self.sampler, chunks, None, {}, t0)
        checkpoints = {c.seq_id: self.sampler.checkpoint(c.seq_id, c.sampling)
                       for c in chunks if c.num_draft_tokens}
        tokens = (self.sampler.greedy_async(out, sample_chunks) if greedy
                  else self.sampler.sample_async(out, sample_chunks))
        return PendingStep(self.sampler, chunks, tokens, checkpoints, t0)

    def _check(self, c: SeqChunk) -> None:
        """Scheduler bugs surface here as ValueError rather than as silent cache corruption."""
        n = len(c.token_ids)
        end = c.start_pos + n
        if n == 0:
            raise ValueError(f"seq {c.seq_id}: chunk has no tokens")
        if c.start_pos < 0 or end > self.max_context:
            raise ValueError(f"seq {c.seq_id}: positions [{c.start_pos}, {end}) exceed max_context {self.max_context}")
        need = -(-end // self.block_size)
        if len(c.block_table) < need:
            raise ValueError(f"seq {c.seq_id}: block_table has {len(c.block_table)} blocks, needs {need}")
        if any(b < 0 or b >= self.num_blocks for b in c.block_table[:need]):
            raise ValueError(f"seq {c.seq_id}: block id out of range [0, {self.num_blocks})")
        if any(t < 0 or t >= self.vocab_size for t in c.token_ids):
            raise ValueError(f"seq {c.seq_id}: token id out of range [0, {self.vocab_size})")


class PendingStep:
    """A submitted step (ModelRunner.submit): `result()` waits for its tokens once and keeps
    each speculative chunk's drafts while they equal what was sampled."""

    def __init__(self, sampler: Sampler, chunks: list[SeqChunk], tokens: PendingTokens | None,
                 checkpoints: dict, started: float):
        self._sampler, self._chunks, self._tokens = sampler, chunks, tokens
        self._checkpoints, self._started = checkpoints, started

    def result(self) -> RunnerOutput:
        out = RunnerOutput(sampled={})
        if self._tokens is not None:
            tokens = self._tokens.wait()
            i = 0
            for c in self._chunks:
                if not c.sample:
                    continue
                k = c.num_draft_tokens
                row = tokens[i:i + k + 1]
                i += k + 1
                # A draft is a point guess: keeping it while it equals the token sampled at
                # its position, and otherwise that sample, is rejection sampling (accept with
                # p(draft); on rejection the sample is distributed as p without the draft).
                n = 0
                for d, t in zip(c.draft_token_ids, row):
                    if d != t.token_id:
                        break
                    n += 1
                out.sampled[c.seq_id] = row[n]
                if k:
                    out.accepted[c.seq_id] = row[:n]
                    if self._checkpoints[c.seq_id] is not None:
                        # one draw per token kept, as plain decoding would have made
                        self._sampler.rewind(c.seq_id, self._checkpoints[c.seq_id], n + 1)
        out.seconds = time.perf_counter() - self._started
        return out


def _is_decode(c: SeqChunk) -> bool:
    """A chunk computed row by row as decodes: a speculative one, or one token after a cached
    context that is not a prompt's (a burst's prompts hold their last token for a final step
    together: those rows stay prompt rows, so a step of them is still a prompt step, bfloat16
    GEMMs and all)."""
    if c.start_pos == 0:
        return False
    return c.num_draft_tokens > 0 or (len(c.token_ids) == 1 and c.start_pos >= len(c.prompt_token_ids))


def _draft_rows(c: SeqChunk) -> list[SeqChunk]:
    """One chunk per sampled position of a speculative chunk; row i follows drafts[:i], so
    penalties see the output as it would be there."""
    p = c.sampling
    if not p.penalized:
        return [c] * (c.num_draft_tokens + 1)
    drafts = c.draft_token_ids
    return [dataclasses.replace(c, output_token_ids=c.output_token_ids + drafts[:i])
            for i in range(len(drafts) + 1)]


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30
