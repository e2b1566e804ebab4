"""The CUDA fast path: decode steps replayed as CUDA graphs.

A decode-only step of n rows (one new token each, no drafts) is padded up to a bucket
(BUCKETS: 1, 2, 4, ... 64) and replayed from a graph captured once per bucket at start-up,
so the ~20 kernels per layer launch as one. A graph reads static buffers, so every step
writes its inputs into one pinned host array and copies it to the device in one transfer:

    row r: [token id, position, KV slot, context length, block table (width W)]

Padded rows (r >= n) decode token 0 at position 0 into a scratch KV block that the runner
allocates beyond the blocks it reports (no request ever owns it) and attend to that one slot;
their logits are dropped (`run` returns the first n rows). A row's table is written only as
far as it has blocks: the columns after them keep earlier, still valid ids, which the paged
kernel never reads (it stops at the row's context length). Rows longer than W blocks, steps
with prefill or draft tokens, and batches above the largest bucket run eagerly.

Capture happens only on CUDA, only with a paged decode kernel (a gather over W blocks per
row would read far more than eager does), and never when the engine runs with --eager.
The bucket and packing logic is plain Python/NumPy, unit-tested on the CPU.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from services.engine.attention import AttentionMetadata, KVCache
from services.engine.device import is_cuda
from services.engine.interface import SeqChunk
from tokenserve.runtime.logging import get_logger

log = get_logger(component="engine.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Static block tables cover this many positions; a row past it decodes eagerly.
MAX_GRAPH_CONTEXT = 8192
# Columns of a packed row before its block table.
TOKEN, POSITION, SLOT, CONTEXT = range(4)
HEADER = 4


def bucket_for(n: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
    """The smallest bucket holding n rows (None: more rows than the largest bucket)."""
    return next((b for b in buckets if b >= n), None)


def graph_buckets(max_num_seqs: int, buckets: tuple[int, ...] = BUCKETS) -> tuple[int, ...]:
    """Buckets worth capturing for an engine running at most max_num_seqs rows."""
    top = bucket_for(max_num_seqs, buckets) or buckets[-1]
    return tuple(b for b in buckets if b <= top)


def is_plain_decode(c: SeqChunk) -> bool:
    return len(c.token_ids) == 1 and c.num_draft_tokens == 0 and c.start_pos > 0


def fits(chunks: list[SeqChunk], buckets: tuple[int, ...], max_context: int) -> bool:
    """Whether a step can replay a graph: 1..max bucket plain decodes, each within max_context."""
    return (0 < len(chunks) <= buckets[-1]
            and all(is_plain_decode(c) and c.start_pos < max_context for c in chunks))


def table_width(max_context: int, block_size: int) -> int:
    return -(-min(max_context, MAX_GRAPH_CONTEXT) // block_size)


def new_staging(rows: int, width: int, block_size: int, scratch_block: int,
                pin: bool = False) -> torch.Tensor:
    """[rows, HEADER + width] int64, every row a padded row (pinned for async copies)."""
    t = torch.full((rows, HEADER + width), scratch_block, dtype=torch.long)
    t[:, TOKEN] = 0
    t[:, POSITION] = 0
    t[:, SLOT] = scratch_block * block_size
    t[:, CONTEXT] = 1
    return t.pin_memory() if pin else t


def pack(stage: np.ndarray, chunks: list[SeqChunk], bucket: int, block_size: int,
         scratch_block: int) -> None:
    """Writes the decode rows of `chunks` and bucket - len(chunks) padded rows into the
    first `bucket` rows of `stage` ([rows, HEADER + width] int64)."""
    n = len(chunks)
    width = stage.shape[1] - HEADER
    for r, c in enumerate(chunks):
        pos = c.start_pos
        nb = pos // block_size + 1
        if nb > width:
            raise ValueError(f"seq {c.seq_id}: position {pos} is past the graphs' {width} blocks")
        row = stage[r]
        row[TOKEN] = c.token_ids[0]
        row[POSITION] = pos
        row[SLOT] = c.block_table[pos // block_size] * block_size + pos % block_size
        row[CONTEXT] = pos + 1
        row[HEADER:HEADER + nb] = c.block_table[:nb]
    pad = stage[n:bucket]
    pad[:, TOKEN] = 0
    pad[:, POSITION] = 0
    pad[:, SLOT] = scratch_block * block_size
    pad[:, CONTEXT] = 1
    pad[:, HEADER] = scratch_block


def unpack(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Device rows [b, HEADER + W] -> (token ids [b], positions [b], decode metadata)."""
    meta = AttentionMetadata(slots=rows[:, SLOT].contiguous(), decode_start=0,
                             decode_blocks=rows[:, HEADER:].contiguous(),
                             decode_ctx=rows[:, CONTEXT].contiguous())
    return rows[:, TOKEN].contiguous(), rows[:, POSITION].contiguous(), meta


def decode_step(model, kv: KVCache, rows: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
    """What a graph captures: packed rows [b, HEADER + W] -> logits [b, V] (padded rows too)."""
    ids, positions, meta = unpack(rows)
    return model.forward(ids, positions, meta, kv, logit_rows)


class DecodeGraphs:
    """One captured decode step per bucket over shared static buffers (see the module doc)."""

    def __init__(self, model, kv: KVCache, *, buckets: tuple[int, ...], block_size: int,
                 max_context: int, scratch_block: int, device: str):
        if not is_cuda(device):
            raise ValueError(f"CUDA graphs need a CUDA device, got {device!r}")
        if not 0 <= scratch_block < kv.num_blocks:
            raise ValueError("the scratch block must be a block of the KV cache")
        self.model, self.kv, self.device = model, kv, device
        self.buckets = tuple(sorted(buckets))
        self.block_size, self.scratch_block = block_size, scratch_block
        self.width = table_width(max_context, block_size)
        self.max_context = min(max_context, self.width * block_size)
        top = self.buckets[-1]
        self._host = new_staging(top, self.width, block_size, scratch_block, pin=True)
        self._stage = self._host.numpy()
        self._rows = self._host.to(device)  # the graphs' static input
        self._logit_rows = torch.arange(top, device=device)
        self._copied = torch.cuda.Event()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def fits(self, chunks: list[SeqChunk]) -> bool:
        return fits(chunks, self.buckets, self.max_context)

    def _forward(self, b: int) -> torch.Tensor:
        return decode_step(self.model, self.kv, self._rows[:b], self._logit_rows[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures the largest bucket first, so the smaller ones fit in its memory pool."""
        t0 = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(device=self.device)
        for b in sorted(self.buckets, reverse=True):
            self._rows.copy_(self._host)  # every row padded: the warm-ups write only scratch
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up (Triton compiles here) off the capture
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(b)
            pool = graph.pool()
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("cuda_graphs_captured", buckets=list(self.buckets), table_width=self.width,
                 seconds=round(self.capture_seconds, 2))

    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [len(chunks), V] of a step that `fits`, one row per chunk, in order."""
        n = len(chunks)
        b = bucket_for(n, self.buckets)
        # the previous step's copy has read the stage (a step ends synchronised: no wait)
        self._copied.synchronize()
        pack(self._stage, chunks, b, self.block_size, self.scratch_block)
        self._rows[:b].copy_(self._host[:b], non_blocking=True)
        self._copied.record()
        self._graphs[b].replay()
        return self._logits[b][:n]
