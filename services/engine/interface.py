"""Typed hand-offs between the scheduler (pure Python) and the runner (torch).

    EngineCore.step():  batch = scheduler.schedule()          # Batch
                        out = runner.execute(batch)           # RunnerOutput
                        scheduler.update(batch, out)

This module must not import torch: the scheduler and block manager import it.
KV addressing: position p of a sequence lives in physical block block_table[p // block_size]
at offset p % block_size (slot = block * block_size + offset).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenserve import sampling


@dataclass(frozen=True)
class SamplingParams(sampling.SamplingParams):
    """Validated sampling settings of one request, plus what the engine returns besides the
    token (the controls themselves are defined once, in tokenserve.sampling)."""

    # Return the sampled token's logprob, with this many top alternatives.
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class SeqChunk:
    """One sequence's share of a step: compute KV for token_ids at positions
    [start_pos, start_pos + len(token_ids)), attending to everything before them."""

    seq_id: int
    # Tokens whose KV is computed in this step: [num_new]. Prefill chunks have many,
    # decode chunks one (the last sampled token).
    token_ids: list[int]
    # Position of token_ids[0] = number of tokens already in the KV cache.
    start_pos: int
    # Physical KV blocks covering positions [0, start_pos + len(token_ids)).
    block_table: list[int]
    # True when this chunk reaches the end of the known tokens: sample one next token.
    sample: bool
    sampling: SamplingParams
    # Prompt and generated ids so far (penalties read them; the runner must not mutate).
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Speculative decode: the last num_draft_tokens of token_ids are guesses (after the one
    # known token). The runner samples at every position and accepts the guesses up to the
    # first disagreement (RunnerOutput.accepted), then the token sampled there.
    num_draft_tokens: int = 0

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]


@dataclass
class Batch:
    """What the scheduler asks the runner to compute in one step."""

    chunks: list[SeqChunk]
    # Sequences that ended since the last step: the runner drops their per-sequence
    # state (seeded generators).
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    # Set when the chunk's sampling asked for logprobs.
    logprob: float | None = None
    top: tuple[TopLogprob, ...] = ()


@dataclass
class RunnerOutput:
    # seq_id -> the token sampled for every chunk with sample=True (for a chunk with drafts:
    # the token after the accepted ones).
    sampled: dict[int, SampledToken]
    # seq_id -> the draft tokens accepted, in order, before `sampled` (chunks with drafts).
    accepted: dict[int, list[SampledToken]] = field(default_factory=dict)
    # Seconds the forward pass took (metrics, energy attribution).
    seconds: float = 0.0
