"""One request as the engine core sees it: its tokens, its KV blocks, its progress.

The single rule behind chunked prefill, decode, prefix caching and recompute-preemption:
a sequence has `num_tokens` known tokens (prompt + generated) of which the first
`num_computed_tokens` have their KV in the cache; each step computes some of the rest.
Pure Python: imported by the scheduler, which must not import torch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.interface import SamplingParams
from services.engine.speculation import NgramDrafter


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"            # EOS, a stop token id or a stop string
    LENGTH = "length"        # max_tokens or the model context
    CANCELLED = "cancelled"  # client cancel or deadline
    ERROR = "error"          # the step failed


@dataclass(frozen=True)
class StopCriteria:
    """When generation ends (EOS ids come from the model, the rest from the request)."""

    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # Stop strings, matched on the detokenized text by the engine core.
    stop: tuple[str, ...] = ()


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: StopCriteria
    priority: int = 0
    tenant_id: str = ""
    # time.monotonic() at arrival; deadline is absolute on the same clock (None: none).
    arrival: float = 0.0
    deadline: float | None = None
    # False: never draft for this request (the request opted out of speculation).
    speculation: bool = True

    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of this sequence, in order (prefix cache keys).
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks of block_table already offered to the prefix cache.
    num_registered_blocks: int = 0
    # Prompt tokens found in the prefix cache on first admission (usage.cached_tokens).
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    energy_joules: float = 0.0
    # Prompt-lookup drafting state, made by the scheduler when it first drafts.
    drafter: NgramDrafter | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining(self) -> int:
        """Known tokens whose KV is not computed yet (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
