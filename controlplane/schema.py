"""The one schema for every document under `/tokenserve/v1/` in etcd.

Each document is a frozen dataclass validated on construction; errors are `InvalidArgument`
naming the key, the field and the rule (`tiers/free: requests_per_second must be > 0, got -1`).
Documents serialise to plain JSON objects (`to_dict`) and are parsed back by `parse(key, data)`,
which dispatches on the key (keys are relative to `PREFIX`, e.g. `tiers/free`).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import re
import secrets
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from tokenserve.runtime.errors import InvalidArgument

PREFIX = "/tokenserve/v1/"
KEY_PREFIX = "ts-"
DISPLAY_PREFIX_CHARS = 10

# names of tiers, tenants, models, versions, engines, gateways: safe as one etcd path segment
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_ENDPOINT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")

# What a tier gets at a degradation level: "queue" serves it (the engine's priority queue runs
# it behind higher tiers), "cap_max_tokens" serves it with max_tokens capped, "reject" sheds it.
DEGRADATION_ACTIONS = ("queue", "reject", "cap_max_tokens")
# The level is how far past its threshold the worst signal is: at 1x, 1.5x and 2x of a
# threshold the ladder stands at level 1, 2 and 3.
DEGRADATION_LEVEL_MULTIPLES = (1.0, 1.5, 2.0)
MAX_DEGRADATION_LEVEL = len(DEGRADATION_LEVEL_MULTIPLES)
TIER_LIMIT_FIELDS = ("requests_per_second", "tokens_per_minute", "daily_tokens",
                     "max_concurrency", "priority", "max_tokens")


class _Check:
    """Collects the `where` of a document so each rule reads as one line."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, msg: str) -> None:
        raise InvalidArgument(f"{self.where}: {msg}")

    def name(self, fld: str, value: Any) -> None:
        if not isinstance(value, str) or not _NAME_RE.match(value):
            self.fail(f"{fld} must be 1-128 chars of letters, digits, '.', '_' or '-' "
                      f"starting with a letter or digit, got {value!r}")

    def number(self, fld: str, value: Any, *, integer: bool, minimum: float,
               strict: bool = False) -> None:
        ok_type = (isinstance(value, int) if integer else isinstance(value, (int, float)))
        if isinstance(value, bool) or not ok_type or (not integer and not math.isfinite(value)):
            self.fail(f"{fld} must be {'an integer' if integer else 'a finite number'}, got {value!r}")
        if strict and value <= minimum:
            self.fail(f"{fld} must be > {minimum:g}, got {value!r}")
        if not strict and value < minimum:
            self.fail(f"{fld} must be >= {minimum:g}, got {value!r}")

    def boolean(self, fld: str, value: Any) -> None:
        if not isinstance(value, bool):
            self.fail(f"{fld} must be true or false, got {value!r}")

    def endpoint(self, fld: str, value: Any) -> None:
        m = _ENDPOINT_RE.match(value) if isinstance(value, str) else None
        if m is None or not 0 < int(m.group(2)) < 65536:
            self.fail(f"{fld} must be host:port with a port in 1-65535, got {value!r}")


def _frozen_map(obj: Any, fld: str, value: Mapping) -> None:
    object.__setattr__(obj, fld, MappingProxyType(dict(value)))


@dataclass(frozen=True)
class Tier:
    """Limits for every tenant on the tier; `priority` orders tiers (higher is served first)."""

    name: str
    requests_per_second: float
    tokens_per_minute: int
    daily_tokens: int
    max_concurrency: int
    priority: int
    max_tokens: int

    def __post_init__(self):
        c = _Check(self.key)
        c.name("name", self.name)
        c.number("requests_per_second", self.requests_per_second, integer=False, minimum=0, strict=True)
        for fld in ("tokens_per_minute", "daily_tokens", "max_concurrency", "max_tokens"):
            c.number(fld, getattr(self, fld), integer=True, minimum=0, strict=True)
        c.number("priority", self.priority, integer=True, minimum=0)

    @property
    def key(self) -> str:
        return f"tiers/{self.name}"


@dataclass(frozen=True)
class Tenant:
    """A customer. `overrides` replaces individual tier limits for this tenant only."""

    id: str
    name: str
    tier: str
    enabled: bool = True
    overrides: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self):
        c = _Check(self.key)
        c.name("id", self.id)
        if not isinstance(self.name, str) or not self.name.strip() or len(self.name) > 200:
            c.fail(f"name must be a non-empty string of at most 200 chars, got {self.name!r}")
        c.name("tier", self.tier)
        c.boolean("enabled", self.enabled)
        if not isinstance(self.overrides, Mapping):
            c.fail(f"overrides must be an object of tier limits, got {self.overrides!r}")
        for fld, value in self.overrides.items():
            if fld not in TIER_LIMIT_FIELDS:
                c.fail(f"overrides.{fld} is not a tier limit; allowed: {', '.join(TIER_LIMIT_FIELDS)}")
            c.number(f"overrides.{fld}", value, integer=fld != "requests_per_second",
                     minimum=0, strict=fld != "priority")
        _frozen_map(self, "overrides", self.overrides)

    @property
    def key(self) -> str:
        return f"tenants/{self.id}"

    def effective(self, tier: Tier) -> Tier:
        """The tenant's tier with its overrides applied."""
        return dataclasses.replace(tier, **dict(self.overrides)) if self.overrides else tier


@dataclass(frozen=True)
class ApiKey:
    """An issued key; only the SHA-256 of the full key is ever stored."""

    key_hash: str
    tenant_id: str
    display_prefix: str
    created_at: str  # ISO 8601, UTC
    revoked: bool = False

    def __post_init__(self):
        c = _Check(f"keys/{self.key_hash}" if isinstance(self.key_hash, str) else "keys/?")
        if not isinstance(self.key_hash, str) or not _HASH_RE.match(self.key_hash):
            c.fail(f"key_hash must be 64 lowercase hex chars (sha256), got {self.key_hash!r}")
        c.name("tenant_id", self.tenant_id)
        if (not isinstance(self.display_prefix, str)
                or len(self.display_prefix) != DISPLAY_PREFIX_CHARS
                or not self.display_prefix.startswith(KEY_PREFIX)):
            c.fail(f"display_prefix must be the first {DISPLAY_PREFIX_CHARS} chars of the key "
                   f"(starting {KEY_PREFIX!r}), got {self.display_prefix!r}")
        try:
            _dt.datetime.fromisoformat(str(self.created_at).replace("Z", "+00:00"))
        except ValueError:
            c.fail(f"created_at must be an ISO 8601 timestamp, got {self.created_at!r}")
        c.boolean("revoked", self.revoked)

    @property
    def key(self) -> str:
        return f"keys/{self.key_hash}"


@dataclass(frozen=True)
class DegradationThresholds:
    """Degradation starts when any signal passes its threshold (level 1 at 1x, 2 at 1.5x, 3 at
    2x: DEGRADATION_LEVEL_MULTIPLES). Signals come from the engines' load reports: waiting
    requests per engine (the mean over live engines), the worst engine's TTFT p99, KV blocks
    used over all engines' blocks, and the engines' summed watts over the power budget."""

    queue_depth: int
    ttft_p99_seconds: float
    kv_use_fraction: float  # of the engine's KV blocks, (0, 1]
    power_watts_vs_budget: float  # measured watts / budget watts, e.g. 0.95


@dataclass(frozen=True)
class Degradation:
    """Thresholds and, per tier, the actions taken at degradation level 1, 2, ...

    `ladder["free"] == ("cap_max_tokens", "reject")`: at level 1 free requests have their
    max_tokens capped to `cap_max_tokens`, at level 2 and above they are rejected. A tier
    missing from the ladder is never degraded.

    Hysteresis: a level is entered as soon as a signal reaches it, and left only once every
    signal has stayed below its threshold minus `hysteresis_margin` (a fraction of the
    threshold: 0.1 -> below 90% of it) for `hold_seconds`. `enabled: false` keeps every
    gateway at level 0 (the documents stay as they are).
    """

    thresholds: DegradationThresholds
    ladder: Mapping[str, tuple[str, ...]]
    cap_max_tokens: int = 256
    hysteresis_margin: float = 0.1
    hold_seconds: float = 10.0
    enabled: bool = True

    def __post_init__(self):
        c = _Check(self.key)
        t = self.thresholds
        if not isinstance(t, DegradationThresholds):
            c.fail("thresholds must be an object with queue_depth, ttft_p99_seconds, "
                   "kv_use_fraction, power_watts_vs_budget")
        c.number("thresholds.queue_depth", t.queue_depth, integer=True, minimum=0, strict=True)
        c.number("thresholds.ttft_p99_seconds", t.ttft_p99_seconds, integer=False, minimum=0, strict=True)
        c.number("thresholds.kv_use_fraction", t.kv_use_fraction, integer=False, minimum=0, strict=True)
        if t.kv_use_fraction > 1:
            c.fail(f"thresholds.kv_use_fraction must be <= 1, got {t.kv_use_fraction!r}")
        c.number("thresholds.power_watts_vs_budget", t.power_watts_vs_budget, integer=False,
                 minimum=0, strict=True)
        c.number("cap_max_tokens", self.cap_max_tokens, integer=True, minimum=0, strict=True)
        c.number("hysteresis_margin", self.hysteresis_margin, integer=False, minimum=0)
        if self.hysteresis_margin >= 1:
            c.fail(f"hysteresis_margin must be < 1 (a fraction of each threshold), "
                   f"got {self.hysteresis_margin!r}")
        c.number("hold_seconds", self.hold_seconds, integer=False, minimum=0)
        if self.hold_seconds > 3600:
            c.fail(f"hold_seconds must be <= 3600, got {self.hold_seconds!r}")
        c.boolean("enabled", self.enabled)
        if not isinstance(self.ladder, Mapping):
            c.fail(f"ladder must be an object of tier -> list of actions, got {self.ladder!r}")
        ladder = {}
        for tier, actions in self.ladder.items():
            c.name("ladder tier", tier)
            if isinstance(actions, str) or not isinstance(actions, (list, tuple)):
                c.fail(f"ladder.{tier} must be a list of actions, got {actions!r}")
            if len(actions) > MAX_DEGRADATION_LEVEL:
                c.fail(f"ladder.{tier} has {len(actions)} actions; levels go to "
                       f"{MAX_DEGRADATION_LEVEL}")
            for a in actions:
                if a not in DEGRADATION_ACTIONS:
                    c.fail(f"ladder.{tier}: unknown action {a!r}; allowed: {', '.join(DEGRADATION_ACTIONS)}")
            ladder[tier] = tuple(actions)
        _frozen_map(self, "ladder", ladder)

    @property
    def key(self) -> str:
        return "degradation"

    def action(self, tier: str, level: int) -> str | None:
        """The action for `tier` at degradation `level` (0 = normal -> None); a ladder shorter
        than the level keeps its last action."""
        steps = self.ladder.get(tier, ())
        if level <= 0 or not steps:
            return None
        return steps[min(level, len(steps)) - 1]


# Longest window a canary guard may compare over (gateways keep this much per version).
MAX_CANARY_WINDOW_SECONDS = 600.0


@dataclass(frozen=True)
class CanaryGuard:
    """Limits on a canary `version`, watched by every gateway: when over `window_seconds`
    (and at least `min_requests` of the canary's) its error rate passes `max_error_rate`, or
    its TTFT p99 passes `max_ttft_p99_seconds`, and it is worse than `stable` over the same
    window, a gateway rolls the route back to `stable` at 100%."""

    version: str
    stable: str
    max_error_rate: float | None = None
    max_ttft_p99_seconds: float | None = None
    window_seconds: float = 60.0
    min_requests: int = 20

    def check(self, c: "_Check") -> None:
        c.name("canary.version", self.version)
        c.name("canary.stable", self.stable)
        if self.version == self.stable:
            c.fail(f"canary.stable must differ from canary.version ({self.version!r})")
        if self.max_error_rate is None and self.max_ttft_p99_seconds is None:
            c.fail("canary: give max_error_rate, max_ttft_p99_seconds or both")
        if self.max_error_rate is not None:
            c.number("canary.max_error_rate", self.max_error_rate, integer=False, minimum=0)
            if self.max_error_rate >= 1:
                c.fail(f"canary.max_error_rate must be < 1, got {self.max_error_rate!r}")
        if self.max_ttft_p99_seconds is not None:
            c.number("canary.max_ttft_p99_seconds", self.max_ttft_p99_seconds, integer=False,
                     minimum=0, strict=True)
        c.number("canary.window_seconds", self.window_seconds, integer=False, minimum=0,
                 strict=True)
        if self.window_seconds > MAX_CANARY_WINDOW_SECONDS:
            c.fail(f"canary.window_seconds must be <= {MAX_CANARY_WINDOW_SECONDS:g}, "
                   f"got {self.window_seconds!r}")
        c.number("canary.min_requests", self.min_requests, integer=True, minimum=1)

    def describe(self) -> str:
        limits = []
        if self.max_error_rate is not None:
            limits.append(f"error rate <= {self.max_error_rate:g}")
        if self.max_ttft_p99_seconds is not None:
            limits.append(f"ttft p99 <= {self.max_ttft_p99_seconds:g}s")
        return (f"{self.version}: {' and '.join(limits)} over {self.window_seconds:g}s"
                f" (min {self.min_requests} requests), else back to {self.stable}")


@dataclass(frozen=True)
class Route:
    """How requests for `model` split between its versions (weights are relative).
    `canary`: the guard of a rollout in progress (None: none; absent from older documents)."""

    model: str
    versions: Mapping[str, int]
    sticky: bool = False
    canary: CanaryGuard | None = field(default=None, metadata={"omit_if_none": True})

    def __post_init__(self):
        c = _Check(self.key)
        c.name("model", self.model)
        if not isinstance(self.versions, Mapping) or not self.versions:
            c.fail(f"versions must be a non-empty object of version -> weight, got {self.versions!r}")
        for v, w in self.versions.items():
            c.name("version", v)
            c.number(f"versions.{v}", w, integer=True, minimum=0)
        if sum(self.versions.values()) <= 0:
            c.fail("versions: at least one weight must be > 0")
        c.boolean("sticky", self.sticky)
        if self.canary is not None:
            if not isinstance(self.canary, CanaryGuard):
                c.fail(f"canary must be an object with version, stable and limits, got {self.canary!r}")
            self.canary.check(c)
            for role, v in (("version", self.canary.version), ("stable", self.canary.stable)):
                if v not in self.versions:
                    c.fail(f"canary.{role} {v!r} is not one of the versions "
                           f"({', '.join(sorted(self.versions))})")
        _frozen_map(self, "versions", self.versions)

    @property
    def key(self) -> str:
        return f"routes/{self.model}"


@dataclass(frozen=True)
class ModelVersion:
    artifact: str  # a path, or "builtin:<name>" for a model shipped in a wheel
    max_context: int


@dataclass(frozen=True)
class ModelSpec:
    name: str
    versions: Mapping[str, ModelVersion]
    default_version: str

    def __post_init__(self):
        c = _Check(self.key)
        c.name("name", self.name)
        if not isinstance(self.versions, Mapping) or not self.versions:
            c.fail("versions must be a non-empty object of version -> {artifact, max_context}")
        for v, mv in self.versions.items():
            c.name("version", v)
            if not isinstance(mv, ModelVersion):
                c.fail(f"versions.{v} must be an object with artifact and max_context")
            if not isinstance(mv.artifact, str) or not mv.artifact:
                c.fail(f"versions.{v}.artifact must be a non-empty path, got {mv.artifact!r}")
            c.number(f"versions.{v}.max_context", mv.max_context, integer=True, minimum=0, strict=True)
        if self.default_version not in self.versions:
            c.fail(f"default_version {self.default_version!r} is not one of the versions "
                   f"({', '.join(sorted(self.versions))})")
        _frozen_map(self, "versions", self.versions)

    @property
    def key(self) -> str:
        return f"models/{self.name}"


@dataclass(frozen=True)
class EngineRegistration:
    id: str
    endpoint: str
    model: str
    version: str
    capacity: int  # max concurrent sequences
    # Context length of the model the engine loaded (0: not reported, an older engine).
    max_context: int = 0

    def __post_init__(self):
        c = _Check(self.key)
        c.name("id", self.id)
        c.endpoint("endpoint", self.endpoint)
        c.name("model", self.model)
        c.name("version", self.version)
        c.number("capacity", self.capacity, integer=True, minimum=0, strict=True)
        c.number("max_context", self.max_context, integer=True, minimum=0)

    @property
    def key(self) -> str:
        return f"engines/{self.id}"


@dataclass(frozen=True)
class GatewayRegistration:
    id: str
    endpoint: str
    # The gateway's degradation level now (0-3) and why ("queue_depth 1.6x"); rewritten under
    # the same lease when the level changes (at most once a second), so `tsctl status` shows it.
    degradation_level: int = 0
    degradation_reason: str = ""

    def __post_init__(self):
        c = _Check(self.key)
        c.name("id", self.id)
        c.endpoint("endpoint", self.endpoint)
        c.number("degradation_level", self.degradation_level, integer=True, minimum=0)
        if self.degradation_level > MAX_DEGRADATION_LEVEL:
            c.fail(f"degradation_level must be <= {MAX_DEGRADATION_LEVEL}, "
                   f"got {self.degradation_level!r}")
        if not isinstance(self.degradation_reason, str) or len(self.degradation_reason) > 200:
            c.fail(f"degradation_reason must be a string of at most 200 chars, "
                   f"got {self.degradation_reason!r}")

    @property
    def key(self) -> str:
        return f"gateways/{self.id}"


@dataclass(frozen=True)
class PowerBudget:
    watts: float

    def __post_init__(self):
        _Check(self.key).number("watts", self.watts, integer=False, minimum=0, strict=True)

    @property
    def key(self) -> str:
        return "power_budget"


Document = (Tier | Tenant | ApiKey | Degradation | Route | ModelSpec | EngineRegistration
            | GatewayRegistration | PowerBudget)

# collection prefix (or singleton key) -> document class
COLLECTIONS: dict[str, type] = {
    "tiers": Tier, "tenants": Tenant, "keys": ApiKey, "routes": Route, "models": ModelSpec,
    "engines": EngineRegistration, "gateways": GatewayRegistration,
}
SINGLETONS: dict[str, type] = {"degradation": Degradation, "power_budget": PowerBudget}
_ID_FIELD = {Tier: "name", Tenant: "id", ApiKey: "key_hash", Route: "model", ModelSpec: "name",
             EngineRegistration: "id", GatewayRegistration: "id"}


def split_key(key: str) -> tuple[str, str | None]:
    """`tiers/free` -> ("tiers", "free"); `degradation` -> ("degradation", None)."""
    if key in SINGLETONS:
        return key, None
    kind, sep, ident = key.partition("/")
    if kind not in COLLECTIONS or not sep or not ident or "/" in ident:
        known = sorted([f"{k}/<id>" for k in COLLECTIONS] + list(SINGLETONS))
        raise InvalidArgument(f"{key!r} is not a config key; keys look like: {', '.join(known)}")
    return kind, ident


def to_dict(doc: Document) -> dict:
    """Plain JSON-ready dict (tuples -> lists, mapping proxies -> dicts)."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            # An optional field left unset is left out: documents without it stay as they
            # were, readable by services that predate the field.
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)
                    if not (f.metadata.get("omit_if_none") and getattr(v, f.name) is None)}
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v
    return plain(doc)


def encode(doc: Document) -> bytes:
    return json.dumps(to_dict(doc), sort_keys=True, separators=(",", ":")).encode()


def parse(key: str, data: Mapping | bytes | str) -> Document:
    """Builds and validates the document stored at `key` (relative to PREFIX)."""
    kind, ident = split_key(key)
    if isinstance(data, (bytes, str)):
        try:
            data = json.loads(data)
        except ValueError as e:
            raise InvalidArgument(f"{key}: not valid JSON ({e})") from None
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"{key}: document must be a JSON object, got {type(data).__name__}")
    cls = COLLECTIONS.get(kind) or SINGLETONS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise InvalidArgument(f"{key}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    args = dict(data)
    if ident is not None:
        id_field = _ID_FIELD[cls]
        args.setdefault(id_field, ident)
        if args[id_field] != ident:
            raise InvalidArgument(f"{key}: {id_field} {args[id_field]!r} does not match the key")
    try:
        if cls is Degradation and isinstance(args.get("thresholds"), Mapping):
            args["thresholds"] = DegradationThresholds(**args["thresholds"])
        if cls is Route and isinstance(args.get("canary"), Mapping):
            args["canary"] = CanaryGuard(**args["canary"])
        if cls is ModelSpec and isinstance(args.get("versions"), Mapping):
            args["versions"] = {v: ModelVersion(**mv) if isinstance(mv, Mapping) else mv
                                for v, mv in args["versions"].items()}
        return cls(**args)
    except TypeError as e:
        raise InvalidArgument(f"{key}: {_type_error_text(e)}") from None


def _type_error_text(e: TypeError) -> str:
    msg = str(e)
    m = re.search(r"missing \d+ required (?:positional|keyword-only) arguments?: (.*)", msg)
    if m:
        return f"missing required field(s) {m.group(1)}"
    m = re.search(r"unexpected keyword argument '(\w+)'", msg)
    if m:
        return f"unknown field {m.group(1)!r}"
    return msg.split(".__init__() ")[-1]


# -- API keys -------------------------------------------------------------------------------

def hash_api_key(key: str) -> str:
    """SHA-256 hex of the full key: the only form in which a key is stored."""
    return hashlib.sha256(key.encode()).hexdigest()


def generate_api_key(tenant_id: str, *, now: _dt.datetime | None = None) -> tuple[str, ApiKey]:
    """A new key (`ts-` + 32 random bytes, urlsafe) and its storable record.

    The key is returned exactly once; only its hash goes to etcd.
    """
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    created = (now or _dt.datetime.now(_dt.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return key, ApiKey(key_hash=hash_api_key(key), tenant_id=tenant_id,
                       display_prefix=key[:DISPLAY_PREFIX_CHARS], created_at=created)
