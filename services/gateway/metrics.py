"""Gateway metrics (Prometheus; `tokenserve_gateway_<name>_<unit>`). Labels carry tiers and
status codes only: never tenants' text."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("tokenserve_gateway_requests_total",
                   "Public API calls by tier and final status code", ["method", "tier", "code"])
REQUEST_SECONDS = Histogram(
    "tokenserve_gateway_request_duration_seconds", "Seconds from arrival to the last message",
    ["method"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60))
TIME_TO_FIRST_TOKEN = Histogram(
    "tokenserve_gateway_time_to_first_token_seconds",
    "Seconds from arrival at the gateway to the first generated token", ["tier"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
TOKENS_STREAMED = Counter("tokenserve_gateway_tokens_streamed_total",
                          "Generated tokens streamed to callers", ["tier"])
ENGINE_RETRIES = Counter("tokenserve_gateway_engine_retries_total",
                         "Engine calls retried on another engine before the first token")
USAGE_EVENTS_SENT = Counter("tokenserve_gateway_usage_events_sent_total",
                            "Usage events the meter acknowledged")
USAGE_EVENTS_SPOOLED = Gauge("tokenserve_gateway_usage_spool_events",
                             "Usage events waiting in the local spool for the meter")
ADMISSION_REJECTIONS = Counter("tokenserve_gateway_admission_rejections_total",
                               "Requests refused by a tier limit, by tier and limit",
                               ["tier", "limit"])
QUOTA_STORE_ERRORS = Counter("tokenserve_gateway_quota_store_errors_total",
                             "Calls to the shared quota store (Redis) that failed, by fail mode",
                             ["fail"])
QUOTA_FALLBACK_ADMISSIONS = Counter(
    "tokenserve_gateway_quota_fallback_admissions_total",
    "Requests admitted against this gateway's local share while the quota store was down")
QUOTA_SETTLE_FAILURES = Counter(
    "tokenserve_gateway_quota_settle_failures_total",
    "Settlements the quota store missed (the unused tokens of those requests stay spent)")
REPLICA_EJECTIONS = Counter(
    "tokenserve_gateway_engine_ejections_total",
    "Times an engine replica was taken out of routing (failures, deadlines, health checks)")
REPLICAS_EJECTED = Gauge("tokenserve_gateway_engines_ejected",
                         "Engine replicas out of routing right now")
CANARY_ROLLBACKS = Counter("tokenserve_gateway_canary_rollbacks_total",
                           "Guarded canaries this gateway rolled back, by model and version",
                           ["model", "version"])
DEGRADATION_LEVEL = Gauge(
    "tokenserve_gateway_degradation_level",
    "Degradation level now: 0 normal, 1 free tier max_tokens capped, 2 free shed, 3 standard"
    " shed (as the degradation document's ladder says)")
DEGRADATION_SIGNAL_RATIO = Gauge(
    "tokenserve_gateway_degradation_signal_ratio",
    "Each degradation signal over its threshold (1 = at the threshold: level 1; 1.5: 2; 2: 3)",
    ["signal"])
