"""Shared pieces of the oracle tests: greedy decoding through ModelRunner and transformers."""
from __future__ import annotations

import torch

from services.engine.interface import Batch, SamplingParams, SeqChunk
from services.engine.runner import ModelRunner


def runner_greedy(runner: ModelRunner, prompt: list[int], n: int, *, seq_id: int = 1,
                  prefill_chunk: int = 10_000, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy tokens from the runner: chunked prefill, then one decode per step.
    Blocks are handed out in reverse order so the cache is not trivially contiguous."""
    total = len(prompt) + n
    nb = -(-total // runner.block_size)
    table = list(range(runner.num_blocks - 1, runner.num_blocks - 1 - nb, -1))
    greedy = SamplingParams()
    out: list[int] = []
    for start in range(0, len(prompt), prefill_chunk):
        ids = prompt[start:start + prefill_chunk]
        last = start + len(ids) == len(prompt)
        r = runner.execute(Batch([SeqChunk(seq_id, ids, start, table, last, greedy, prompt)]))
        if last:
            out.append(r.sampled[seq_id].token_id)
    while len(out) < n and out[-1] not in stop_ids:
        pos = len(prompt) + len(out) - 1
        r = runner.execute(Batch([SeqChunk(seq_id, [out[-1]], pos, table, True, greedy, prompt, out)]))
        out.append(r.sampled[seq_id].token_id)
    runner.execute(Batch([], finished_seq_ids=[seq_id]))
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy generate (max n new tokens, stops at EOS)."""
    with torch.inference_mode():
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, top_p=None, top_k=None, temperature=None,
                             pad_token_id=model.config.eos_token_id)
    return ids[0, len(prompt):].tolist()


def hf_argmax_along(model, prompt: list[int], generated: list[int]) -> list[int]:
    """transformers' argmax after prompt + generated[:i] for every i, in one forward pass.

    Equal to `generated` exactly when transformers' greedy decoding would produce the same
    tokens (each step's argmax is conditioned on the same prefix), at the cost of one pass."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated[:-1]])).logits[0]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def runner_last_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """Float32 logits [V] at the prompt's last position, via the model directly."""
    from services.engine.attention import build_metadata

    nb = -(-len(prompt) // runner.block_size)
    meta = build_metadata([(0, len(prompt), list(range(nb)))], runner.block_size, "cpu")
    with torch.inference_mode():
        return runner.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), meta, runner.kv,
                                    torch.tensor([len(prompt) - 1]))[0]


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def hf_greedy_no_eos(model, prompt: list[int], n: int) -> list[int]:
    """Plain argmax decoding by full forwards (no EOS handling): for tiny models only."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
