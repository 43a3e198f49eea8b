"""Every Prometheus metric of the gateway, defined once (contract section 7).

Label values are bounded: route names and the contract's words, never keys, paths or tenants.
Counters are per process and start at zero, the Prometheus convention.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

# Why a request with a known key did not reach the upstream.
BLOCK_REASONS = ("replayed", "in_progress", "unknown")

# A store round trip on loopback takes well under a millisecond; an upstream call milliseconds
# to the route's timeout. The buckets cover both ends.
_STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_REQUEST_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

REQUESTS = Counter(
    "oncegate_requests_total",
    "Requests answered, by route, method and outcome.",
    ["route", "method", "outcome"],
)
DUPLICATES_BLOCKED = Counter(
    "oncegate_duplicates_blocked_total",
    "Requests with a known Idempotency-Key that did not reach the upstream.",
    ["route", "reason"],
)
UPSTREAM_REQUEST_DURATION = Histogram(
    "oncegate_upstream_request_duration_seconds",
    "Time from sending a request upstream to having its whole answer.",
    ["route"],
    buckets=_REQUEST_BUCKETS,
)
REQUEST_DURATION = Histogram(
    "oncegate_request_duration_seconds",
    "Time the gateway took to answer a request, by route and outcome.",
    ["route", "outcome"],
    buckets=_REQUEST_BUCKETS,
)
STORE_OPERATION_DURATION = Histogram(
    "oncegate_store_operation_duration_seconds",
    "Time of one store operation (one PostgreSQL round trip), by operation.",
    ["operation"],
    buckets=_STORE_BUCKETS,
)
STORE_BATCH_SIZE = Histogram(
    "oncegate_store_batch_size",
    "Operations carried by one store statement (concurrent operations of a kind share one), "
    "by operation.",
    ["operation"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
INFLIGHT = Gauge(
    "oncegate_inflight_requests",
    "Requests being forwarded upstream right now.",
    ["route"],
    multiprocess_mode="livesum",  # with --workers: the sum over the live worker processes
)
WAIT_DURATION = Histogram(
    "oncegate_wait_duration_seconds",
    "Time a request with Prefer: wait spent waiting for its key to settle.",
    ["route"],
    buckets=_REQUEST_BUCKETS,
)
KEYS_PURGED = Counter(
    "oncegate_keys_purged_total",
    "Expired keys deleted by the purger.",
)

KEYS = Gauge(
    "oncegate_keys",
    "Keys in the store by state, counted by a periodic sweep of the table (every "
    "key_count_interval); the same database-wide figure from every gateway.",
    ["state"],
    # Every worker sweeps the same table: the freshest figure is the one to show, not a sum.
    multiprocess_mode="livemostrecent",
)


def exposition() -> bytes:
    """The text for `/metrics`: this process's metrics, or with --workers every worker's."""
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]  # untyped upstream
        return generate_latest(registry)
    return generate_latest()
