"""A fake runner with a paged KV store and a deterministic 'model', no torch.

It writes each computed token into its slot (block * block_size + offset) and, before
computing a chunk, reads back every earlier position of the sequence through its block
table. The next token is a function of what it READ, so a wrong block table, a block
overwritten while shared, or a bad prefix-cache hit changes the output (and is caught by
the consistency check first). Chunks with drafts are verified as the real runner does: the
model's token at every position, drafts kept while they agree. A rejected draft's slot holds
a wrong token until it is overwritten: reading it back is a KVMismatch.
"""
from __future__ import annotations

from services.engine.interface import Batch, RunnerOutput, SampledToken, SamplingParams
from services.engine.sequence import Sequence, StopCriteria

VOCAB = 1000
EOS = 999


class KVMismatch(AssertionError):
    pass


class Done:
    """A submitted step whose result is already known (what a CPU runner's submit gives)."""

    def __init__(self, output: RunnerOutput):
        self.output = output

    def result(self) -> RunnerOutput:
        return self.output


class FakeRunner:
    # the step is computed inside submit, as on the CPU; EngineCore(overlap=True) still runs
    # the overlapped order against it
    asynchronous = False

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv: dict[int, int] = {}
        self.batches: list[Batch] = []
        self.finished_seen: list[int] = []
        self.fail_next = False
        # seq_id -> tokens to sample instead of the model's (EOS, stop ids)
        self.script: dict[int, list[int]] = {}
        # the step time it reports: (decode rows, prompt tokens) -> seconds
        self.cost = lambda decode_rows, prompt_tokens: 0.001
        self.model = next_token
        self.layers = 4

    def submit(self, batch: Batch, between_layers=None) -> Done:
        if between_layers is not None:  # a model of `layers` layers, computed at the end
            for done in range(1, self.layers):
                between_layers(done, self.layers)
        return Done(self.execute(batch))

    def execute(self, batch: Batch) -> RunnerOutput:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        self.batches.append(batch)
        self.finished_seen.extend(batch.finished_seq_ids)
        bs = self.block_size
        sampled, accepted = {}, {}
        for c in batch.chunks:
            known = c.prompt_token_ids + c.output_token_ids + c.draft_token_ids
            end = c.start_pos + len(c.token_ids)
            assert len(c.block_table) * bs >= end, "block table does not cover the chunk"
            assert len(set(c.block_table)) == len(c.block_table), "block used twice in a table"
            assert all(0 <= b < self.num_blocks for b in c.block_table)
            # read the cached context
            context = []
            for p in range(c.start_pos):
                slot = c.block_table[p // bs] * bs + p % bs
                if self.kv.get(slot) != known[p]:
                    raise KVMismatch(f"seq {c.seq_id} pos {p}: kv {self.kv.get(slot)} != {known[p]}")
                context.append(self.kv[slot])
            for i, t in enumerate(c.token_ids):
                p = c.start_pos + i
                assert t == known[p], "chunk tokens disagree with the sequence"
                self.kv[c.block_table[p // bs] * bs + p % bs] = t
                context.append(t)
            if c.sample:
                forced = self.script.get(c.seq_id)
                k = c.num_draft_tokens
                n = 0
                for d in c.draft_token_ids:
                    if self.model(context[:len(context) - k + n]) != d:
                        break
                    n += 1
                if n:
                    accepted[c.seq_id] = [SampledToken(d, logprob=-0.5) for d in c.draft_token_ids[:n]]
                elif k:
                    accepted[c.seq_id] = []
                tok = forced.pop(0) if forced and not k else self.model(context[:len(context) - k + n])
                sampled[c.seq_id] = SampledToken(tok, logprob=-0.5)
        decode_rows = sum(1 for c in batch.chunks if len(c.token_ids) - c.num_draft_tokens == 1)
        return RunnerOutput(sampled=sampled, accepted=accepted,
                            seconds=self.cost(decode_rows, batch.num_tokens - decode_rows))


def next_token(context: list[int]) -> int:
    """Deterministic 'model': never EOS (998 max), depends on the whole context."""
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return h % (VOCAB - 2)


def make_seq(seq_id: int, prompt_len: int = 10, *, max_tokens: int = 8, priority: int = 0,
             tenant: str = "t", arrival: float | None = None, prompt: list[int] | None = None,
             stop_ids=(), ignore_eos: bool = False, deadline: float | None = None,
             logprobs: bool = False, stop: tuple[str, ...] = (), speculation: bool = True) -> Sequence:
    toks = prompt if prompt is not None else [(seq_id * 17 + i) % 900 + 1 for i in range(prompt_len)]
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", prompt_token_ids=list(toks),
                    sampling=SamplingParams(logprobs=logprobs),
                    stop=StopCriteria(max_tokens=max_tokens, stop_token_ids=frozenset(stop_ids),
                                      ignore_eos=ignore_eos, stop=stop),
                    priority=priority, tenant_id=tenant, speculation=speculation,
                    arrival=float(seq_id) if arrival is None else arrival, deadline=deadline)


def copying_token(context: list[int]) -> int:
    """A 'model' that mostly continues the latest earlier occurrence of its last token (as
    code edits copy their prompt) and otherwise jumps to some token of its context: drafts
    are often right, not always."""
    h = next_token(context)
    if h % 4:
        last = context[-1]
        for p in range(len(context) - 2, -1, -1):
            if context[p] == last:
                return context[p + 1]
    return context[h % len(context)]


def reference_output(prompt: list[int], max_tokens: int, model=next_token) -> list[int]:
    """What the fake model generates for prompt alone (unbatched, no cache)."""
    ctx = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = model(ctx)
        out.append(t)
        ctx.append(t)
    return out
