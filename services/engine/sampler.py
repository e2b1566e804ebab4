"""Next-token sampling for a batch of sequences, vectorised over the batch.

Order per row: penalties (repetition over prompt + output, presence / frequency over output)
-> logprobs (of the penalised distribution at temperature 1) -> greedy argmax, or temperature
-> min_p -> top_k -> top_p -> one draw by inverse CDF.

Each draw takes exactly one uniform number from the sequence's own torch.Generator (seeded
sequences) or from the sampler's shared one, so a seeded request gives the same tokens
whatever else is in the batch. Speculative verification samples every draft position and
then rewinds a seeded generator to one draw per token kept (`rewind`), so a seeded request
also gives the same tokens with or without drafts.

On CUDA everything above runs on the device; only the uniforms are drawn on the host, from
the same generators (so seeded requests and speculation's rewind behave exactly as on the
CPU), and copied without a wait. Every host -> device copy goes through device.to_device
and the results come back in one device.HostCopy: one host synchronisation per step, which
`sample_async` leaves to its caller (the runner waits for it after the host's other work).
"""
from __future__ import annotations

import torch

from services.engine import cpu_kernels
from services.engine.device import HostCopy, to_device
from services.engine.interface import SampledToken, SamplingParams, SeqChunk, TopLogprob


class Sampler:
    def __init__(self, device: str = "cpu", seed: int | None = None, kernels: bool = True):
        """kernels: greedy argmax through the AVX2 kernel on the CPU (torch.argmax otherwise)."""
        self.device = device
        self._lib = cpu_kernels.load() if kernels and device == "cpu" else None
        self._shared = torch.Generator(device="cpu")
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self._lib is not None and logits.dtype == torch.float32:
            return cpu_kernels.argmax_rows(self._lib, logits)
        return torch.argmax(logits, dim=-1)

    def forget(self, seq_ids) -> None:
        """Drop per-sequence generators of finished sequences."""
        for s in seq_ids:
            self._seeded.pop(s, None)

    def checkpoint(self, seq_id: int, params: SamplingParams) -> torch.Tensor | None:
        """State of a seeded sequence's generator (None when it draws from the shared one)."""
        if params.greedy or params.seed is None:
            return None
        return self._generator(seq_id, params).get_state()

    def rewind(self, seq_id: int, state: torch.Tensor, draws: int) -> None:
        """Back to `state`, then `draws` draws on, as if only those had been made."""
        g = self._seeded[seq_id]
        g.set_state(state)
        for _ in range(draws):
            torch.rand(1, generator=g)

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._shared
        g = self._seeded.get(seq_id)
        if g is None:
            g = self._seeded[seq_id] = torch.Generator(device="cpu")
            g.manual_seed(params.seed)
        return g

    def sample(self, logits: torch.Tensor, chunks: list[SeqChunk]) -> list[SampledToken]:
        """logits: float32 [S, V], row i belongs to chunks[i]. Returns one token per row."""
        return self.sample_async(logits, chunks).wait()

    def greedy_async(self, token_ids: torch.Tensor, chunks: list[SeqChunk]) -> "PendingTokens":
        """`sample_async` for rows that are all plain greedy (no penalties, no logprobs) whose
        argmax the model already took (int64 [S]: LlamaModel.forward with greedy)."""
        return PendingTokens(HostCopy([token_ids]), [c.sampling for c in chunks], False, False)

    def sample_async(self, logits: torch.Tensor, chunks: list[SeqChunk]) -> "PendingTokens":
        """`sample` with the wait for the device left to the caller: every draw is made
        (the generators have moved on) and the results are on their way to the host."""
        params = [c.sampling for c in chunks]
        logits = apply_penalties(logits, chunks)
        want_lp = any(p.logprobs for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None

        token_ids = self._argmax(logits)  # greedy for every row; sampled rows overwritten
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            dev = logits.device
            u = torch.cat([torch.rand(1, generator=self._generator(chunks[i].seq_id, params[i]))
                           for i in rows])
            at = to_device(rows, torch.long, dev)
            token_ids[at] = sample_rows(logits[at], [params[i] for i in rows],
                                        to_device(u, torch.float32, dev))

        top_n = max((p.top_logprobs for p in params if p.logprobs), default=0)
        top = torch.topk(logprobs, top_n, dim=-1) if want_lp and top_n > 0 else None
        wanted = [token_ids]
        if want_lp:
            wanted.append(logprobs.gather(1, token_ids[:, None]).squeeze(1))
        if top is not None:
            wanted += [top.values, top.indices]
        return PendingTokens(HostCopy(wanted), params, want_lp, top is not None)


class PendingTokens:
    """A step's sampled tokens on their way to the host."""

    def __init__(self, copy: HostCopy, params: list[SamplingParams], want_lp: bool, top: bool):
        self._copy, self._params, self._want_lp, self._top = copy, params, want_lp, top

    def wait(self) -> list[SampledToken]:
        """One token per row, once the device has produced them (the step's one wait)."""
        host = self._copy.wait()
        ids = host[0]
        chosen = host[1] if self._want_lp else None
        out: list[SampledToken] = []
        for i, (tid, p) in enumerate(zip(ids, self._params)):
            if not p.logprobs:
                out.append(SampledToken(tid))
                continue
            alts: tuple[TopLogprob, ...] = ()
            if self._top and p.top_logprobs > 0:
                vals = host[2][i][:p.top_logprobs]
                idx = host[3][i][:p.top_logprobs]
                alts = tuple(TopLogprob(t, v) for t, v in zip(idx, vals))
            out.append(SampledToken(tid, chosen[i], alts))
        return out


def apply_penalties(logits: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
    """Repetition (HF/vLLM style, prompt + output), presence and frequency (output only)."""
    rows = [i for i, c in enumerate(chunks) if c.sampling.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    v = logits.shape[1]
    dev = logits.device
    at = to_device(rows, torch.long, dev)
    sub = logits[at]  # [R, V]
    out_counts = torch.zeros_like(sub)
    seen = torch.zeros(sub.shape, dtype=torch.bool, device=dev)
    for r, i in enumerate(rows):
        c = chunks[i]
        # ids outside the vocabulary dropped on the host (a mask index would wait on CUDA)
        out_ids = to_device([t for t in c.output_token_ids if t < v], torch.long, dev)
        prompt_ids = to_device([t for t in c.prompt_token_ids if t < v], torch.long, dev)
        out_counts[r].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=sub.dtype))
        seen[r, out_ids] = True
        seen[r, prompt_ids] = True
    f32 = torch.float32
    rep = to_device([chunks[i].sampling.repetition_penalty for i in rows], f32, dev)[:, None]
    pres = to_device([chunks[i].sampling.presence_penalty for i in rows], f32, dev)[:, None]
    freq = to_device([chunks[i].sampling.frequency_penalty for i in rows], f32, dev)[:, None]
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
    logits[at] = sub
    return logits


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """logits: [R, V] of non-greedy rows; u: [R] uniforms in [0, 1). Returns token ids [R]."""
    dev = logits.device
    f32 = torch.float32
    temp = to_device([p.temperature for p in params], f32, dev)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    if any(p.min_p > 0 for p in params):  # decided on the host: no wait on CUDA
        min_p = to_device([p.min_p for p in params], f32, dev)
        floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    need_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
    if need_sort:
        probs, order = torch.sort(probs, dim=-1, descending=True)  # [R, V]
        v = probs.shape[1]
        top_k = to_device([p.top_k if p.top_k > 0 else v for p in params], torch.long, dev)
        rank = torch.arange(v, device=dev)[None, :]
        probs = torch.where(rank < top_k[:, None], probs, torch.zeros_like(probs))
        top_p = to_device([p.top_p for p in params], f32, dev)[:, None]
        before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        total = probs.sum(dim=-1, keepdim=True)
        # Keep a token while the mass before it is below top_p (the first token always stays).
        probs = torch.where(before < top_p * total, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[:, -1])[:, None]
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=probs.shape[1] - 1)
    # A row whose chosen slot has zero probability (rounding at the very top of the CDF)
    # falls back to its last non-zero token.
    pick = torch.where(probs.gather(1, pick) > 0, pick,
                       (probs > 0).int().cumsum(-1).argmax(dim=-1, keepdim=True))
    if need_sort:
        pick = order.gather(1, pick)
    return pick.squeeze(1)
