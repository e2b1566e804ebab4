"""Model -> version (route weights, stickiness) -> engine replica (load, health, affinity).

Engines come from two places: registrations in the config snapshot (engines that announced
themselves in etcd under a lease) and `--engine model=version=host:port` flags. A model is
known when it has a route, a model spec, or an engine.

Version: by route weight among versions with a routable engine. A request with a session key
(`x-session-id`) always lands on the same version while the weights stay the same; with
`Route.sticky` a tenant does. Replica: the lowest `score` among the version's replicas that
are in routing (health.ReplicaHealth); when every replica of the model is ejected, all are
tried (an ejection must not turn one slow replica into a refused model). With prefix
affinity, the replica that served the prompt's longest known prefix wins unless it is much
busier (affinity.AffinityPolicy.keeps).
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import structlog

from controlplane.snapshot import ConfigSnapshot
from services.gateway.affinity import PrefixAffinity
from services.gateway.config import StaticEngine
from services.gateway.health import ReplicaHealth
from tokenserve.runtime.errors import NotFound, Unavailable

# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="routing")


@dataclass(frozen=True)
class Target:
    model: str
    version: str
    endpoint: str


@dataclass(frozen=True)
class ModelInfo:
    name: str
    # (version, weight), versions in name order.
    versions: tuple[tuple[str, int], ...]
    max_context: int


class ReplicaLoad(Protocol):
    """What an engine last reported about its load (gateway load board)."""

    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int


# KV use counted at most this full, so one report cannot make a replica's score infinite.
KV_USE_CAP = 0.95


def load_factor(load: ReplicaLoad | None) -> float:
    """How much busier than its outstanding tokens alone a replica is: (1 + waiting) /
    (1 - kv_used/kv_total). A request queued there waits behind every waiting one, and a
    nearly full KV cache means preemption; 1.0 when nothing is known."""
    if load is None:
        return 1.0
    factor = 1.0 + max(0, load.waiting)
    if load.kv_blocks_total > 0:
        used = min(max(load.kv_blocks_used / load.kv_blocks_total, 0.0), KV_USE_CAP)
        factor /= 1.0 - used
    return factor


class Router:
    def __init__(self, static_engines: Sequence[StaticEngine], default_model: str,
                 rng: random.Random | None = None, *,
                 load_of: Callable[[str], ReplicaLoad | None] | None = None,
                 health: ReplicaHealth | None = None,
                 affinity: PrefixAffinity | None = None):
        self._static = tuple(static_engines)
        self._default_model = default_model
        self._rng = rng or random.Random()
        self._load_of = load_of
        self.health = health
        self.affinity = affinity
        # endpoint -> prompt + max_tokens of requests in flight there.
        self._outstanding: dict[str, int] = {}
        # (engine id, version, engine's limit, etcd's) of each mismatch already logged.
        self._context_logged: set[tuple[str, str, int, int]] = set()

    # -- what exists ----------------------------------------------------------------------
    def _engines(self, snap: ConfigSnapshot, model: str) -> dict[str, list[str]]:
        """version -> endpoints serving it."""
        found: dict[str, list[str]] = {}
        for e in snap.engines_for(model):
            found.setdefault(e.version, []).append(e.endpoint)
        for e in self._static:
            if e.model == model and e.endpoint not in found.get(e.version, []):
                found.setdefault(e.version, []).append(e.endpoint)
        return found

    def models(self, snap: ConfigSnapshot) -> list[ModelInfo]:
        names = set(snap.routes) | set(snap.models) | {e.model for e in snap.engines.values()}
        names |= {e.model for e in self._static}
        out = []
        for name in sorted(names):
            route = snap.routes.get(name)
            if route is not None:
                versions = tuple(sorted(route.versions.items()))
            else:
                versions = tuple((v, 1) for v in sorted(self._engines(snap, name)))
            out.append(ModelInfo(name, versions, self.max_context(snap, name)))
        return out

    @staticmethod
    def _configured_context(snap: ConfigSnapshot, model: str, version: str | None = None) -> int:
        """etcd's max_context for `version` of `model` (None or a version the spec lacks: the
        default version's); 0 without a model spec."""
        spec = snap.models.get(model)
        if spec is None:
            return 0
        mv = spec.versions.get(version) if version else None
        mv = mv or spec.versions.get(spec.default_version)
        return mv.max_context if mv else 0

    def max_context(self, snap: ConfigSnapshot, model: str) -> int:
        """The context a request for `model` must fit: the smallest of etcd's (the default
        version's, and that of each live engine's version) and what each live engine reported
        for the model it loaded; 0 when none is known."""
        limits = [self._configured_context(snap, model)]
        for e in snap.engines_for(model):
            limits += [e.max_context, self._configured_context(snap, model, e.version)]
        return min((n for n in limits if n), default=0)  # 0: not known

    def log_context_mismatches(self, snap: ConfigSnapshot) -> None:
        """Warns once for each registered engine whose context limit differs from etcd's for
        its model version. Call with the first snapshot and every change after it (a new
        engine, or a changed model spec, is logged as soon as both figures are known)."""
        live = set()
        for e in sorted(snap.engines.values(), key=lambda e: e.id):
            configured = self._configured_context(snap, e.model, e.version)
            if not e.max_context or not configured or e.max_context == configured:
                continue
            key = (e.id, e.version, e.max_context, configured)
            live.add(key)
            if key not in self._context_logged:
                log.warning("engine_context_mismatch", model=e.model, version=e.version,
                            engine=e.id, etcd_max_context=configured,
                            engine_max_context=e.max_context,
                            using=min(e.max_context, configured))
        # Only what is still registered: an engine that comes back is logged again.
        self._context_logged = live

    def resolve_model(self, snap: ConfigSnapshot, name: str) -> str:
        """The model to serve for a request's `model` field (empty: the default)."""
        model = name or self._default_model
        known = [m.name for m in self.models(snap)]
        if model not in known:
            raise NotFound(f"model {model!r} is not served here; available models:"
                           f" {', '.join(known) or '(none)'}")
        return model

    # -- choice ---------------------------------------------------------------------------
    def check_available(self, snap: ConfigSnapshot, model: str) -> None:
        """Unavailable when no engine serves a routed version of `model` (checked before
        tokenizing, so the caller hears about the missing engine, not a tokenizer error)."""
        engines = self._engines(snap, model)
        route = snap.routes.get(model)
        if not any(v in engines for v in (
                [v for v, w in route.versions.items() if w > 0] if route else engines)):
            raise Unavailable(f"no engine is serving model {model!r} right now; retry later")

    def choose(self, snap: ConfigSnapshot, model: str, *, tenant_id: str = "",
               session_id: str = "", prompt_ids: Sequence[int] = (),
               exclude: frozenset[str] = frozenset()) -> Target:
        """A version by route weight among versions with a routable engine, then its best
        replica. `exclude`: endpoints that already failed this request."""
        engines = {v: [ep for ep in eps if ep not in exclude]
                   for v, eps in self._engines(snap, model).items()}
        engines = {v: eps for v, eps in engines.items() if eps}
        if self.health is not None:
            routable = {v: [ep for ep in eps if self.health.routable(ep)]
                        for v, eps in engines.items()}
            routable = {v: eps for v, eps in routable.items() if eps}
            engines = routable or engines  # every replica out: try them all anyway
        route = snap.routes.get(model)
        if route is not None:
            weights = {v: w for v, w in route.versions.items() if w > 0 and v in engines}
        else:
            weights = {v: 1 for v in engines}
        if not weights:
            raise Unavailable(f"no engine is serving model {model!r} right now; retry later")
        if session_id:
            sticky_key = f"session/{tenant_id}/{session_id}/{model}"
        elif route is not None and route.sticky:
            sticky_key = f"{tenant_id}/{model}"
        else:
            sticky_key = None
        version = self._pick_version(weights, sticky_key)
        return Target(model, version, self._pick_replica(
            engines[version], f"{tenant_id}/{model}/{version}", prompt_ids))

    def _pick_replica(self, endpoints: list[str], scope: str, prompt_ids: Sequence[int]) -> str:
        if len(endpoints) == 1:
            return endpoints[0]  # nothing to weigh (and no prefix keys to hash per request)
        scores = {ep: self.score(ep) for ep in endpoints}
        best = min(endpoints, key=lambda ep: (scores[ep], ep))
        if self.affinity is None or not prompt_ids:
            return best
        keys = self.affinity.keys(scope, prompt_ids)
        match = self.affinity.match(keys, scores)
        if match is not None and self.affinity.policy.keeps(scores[match.endpoint], scores[best]):
            best = match.endpoint
        self.affinity.remember(keys, best)
        return best

    def _pick_version(self, weights: dict[str, int], sticky_key: str | None) -> str:
        versions = sorted(weights)
        total = sum(weights[v] for v in versions)
        if sticky_key is not None:
            # The same tenant lands on the same version while the weights stay the same.
            point = int.from_bytes(hashlib.sha256(sticky_key.encode()).digest()[:8], "big") % total
        else:
            point = self._rng.randrange(total)
        for v in versions:
            point -= weights[v]
            if point < 0:
                return v
        return versions[-1]

    # -- load -----------------------------------------------------------------------------
    def acquire(self, endpoint: str, tokens: int) -> None:
        self._outstanding[endpoint] = self._outstanding.get(endpoint, 0) + tokens

    def release(self, endpoint: str, tokens: int) -> None:
        left = self._outstanding.get(endpoint, 0) - tokens
        if left > 0:
            self._outstanding[endpoint] = left
        else:
            self._outstanding.pop(endpoint, None)

    def outstanding(self, endpoint: str) -> int:
        return self._outstanding.get(endpoint, 0)

    def score(self, endpoint: str) -> float:
        """Lower is less loaded: (outstanding tokens + 1) x load_factor(the engine's report).
        The + 1 lets the engine's report order replicas this gateway sends nothing to."""
        load = self._load_of(endpoint) if self._load_of is not None else None
        return (self._outstanding.get(endpoint, 0) + 1) * load_factor(load)
