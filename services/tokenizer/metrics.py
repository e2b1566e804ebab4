"""Prometheus metrics of the tokenizer service (default registry, served by the runtime)."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "tokenserve_tokenizer_requests_total", "Tokenizer RPCs by method and status code.",
    ["method", "code"])
LATENCY = Histogram(
    "tokenserve_tokenizer_request_duration_seconds", "Tokenizer RPC handling time.", ["method"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0))
TOKENS_ENCODED = Counter(
    "tokenserve_tokenizer_tokens_encoded_total", "Tokens produced by Encode/Count RPCs.", ["model"])
TOKENS_DECODED = Counter(
    "tokenserve_tokenizer_tokens_decoded_total", "Tokens turned back into text.", ["model"])
