"""Model -> version (route weights) -> engine replica (fewest outstanding tokens).

Engines come from two places: registrations in the config snapshot (engines that announced
themselves in etcd under a lease) and `--engine model=version=host:port` flags. A model is
known when it has a route, a model spec, or an engine.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Sequence

import structlog

from controlplane.snapshot import ConfigSnapshot
from services.gateway.config import StaticEngine
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


class Router:
    def __init__(self, static_engines: Sequence[StaticEngine], default_model: str,
                 rng: random.Random | None = None):
        self._static = tuple(static_engines)
        self._default_model = default_model
        self._rng = rng or random.Random()
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
               exclude: frozenset[str] = frozenset()) -> Target:
        """A version by route weight among versions with a live engine, then its least
        loaded engine. `exclude`: endpoints that already failed this request."""
        engines = {v: [ep for ep in eps if ep not in exclude]
                   for v, eps in self._engines(snap, model).items()}
        engines = {v: eps for v, eps in engines.items() if eps}
        route = snap.routes.get(model)
        if route is not None:
            weights = {v: w for v, w in route.versions.items() if w > 0 and v in engines}
        else:
            weights = {v: 1 for v in engines}
        if not weights:
            raise Unavailable(f"no engine is serving model {model!r} right now; retry later")
        sticky_key = f"{tenant_id}/{model}" if route is not None and route.sticky else None
        version = self._pick_version(weights, sticky_key)
        endpoint = min(engines[version], key=lambda ep: (self._outstanding.get(ep, 0), ep))
        return Target(model, version, endpoint)

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
