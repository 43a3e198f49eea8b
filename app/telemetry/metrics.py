"""Every Prometheus metric of the gateway, defined once (contract section 7).

Label values are bounded: route names and the contract's words, never keys, paths or tenants.
Counters are per process and start at zero, the Prometheus convention.

Where values live is chosen by one explicit call, `setup`, not by the order of imports:
- `setup()`: in this process's memory; /metrics shows them.
- `setup(multiprocess_dir=DIR)` (`serve --workers N`): in files under DIR, one set per process;
  the forked workers inherit the choice, and /metrics adds up every worker's files.
prometheus_client alone picks a value's home when the value is made, from
`PROMETHEUS_MULTIPROC_DIR` as it stood at its own first import; and values are made at import
time (the store's operation timers, the unlabelled counter). So every value here is made
`_Deferred`: it takes its home at its first use, from `setup`, whatever was imported first.
Rules: `setup` runs before the first observation (it refuses to run after one); the gateway's
runtime refuses to start without it (`require_setup`). A process that never calls it (a script
using the agent's checkpoint store) keeps prometheus_client's own choice, as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar, cast

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

from ..model import outcomes

# prometheus_client's own choice, kept for processes that never call `setup`.
_UNCHOSEN: Any = values.ValueClass
# The class chosen by `setup`, and the multiprocess directory ("" for one process).
_chosen: Any = None
_directory = ""
_made = 0  # values that have taken their home: `setup` must come before the first


class MetricsNotSetUp(RuntimeError):
    """The gateway was started without `metrics.setup`."""


class _Deferred:
    """A metric's value that takes its home (memory or a worker's file) at its first use. Then
    its methods are the real value's own, so an observation costs what it did before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._arguments = (args, kwargs)

    def _home(self) -> Any:
        global _made
        args, kwargs = self._arguments
        real = (_UNCHOSEN if _chosen is None else _chosen)(*args, **kwargs)
        _made += 1
        for name in ("inc", "set", "set_exemplar", "get", "get_exemplar"):
            setattr(self, name, getattr(real, name))
        return real

    def inc(self, amount: float) -> None:
        self._home().inc(amount)

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._home().set(value, timestamp)

    def set_exemplar(self, exemplar: Any) -> None:
        self._home().set_exemplar(exemplar)

    def get(self) -> float:
        return float(self._home().get())

    def get_exemplar(self) -> Any:
        return self._home().get_exemplar()


# Every value prometheus_client makes from here on is deferred: the metrics below, and their
# labelled children made later.
values.ValueClass = _Deferred


def setup(multiprocess_dir: str | Path | None = None) -> None:
    """Choose where every value lives: in memory, or with `multiprocess_dir` in files that
    /metrics adds up across processes. Once per process, before the first observation."""
    global _chosen, _directory
    if _chosen is not None:
        raise RuntimeError("metrics.setup was called twice")
    if _made:
        raise RuntimeError(
            f"metrics.setup came after {_made} values were used: they would stay where "
            "prometheus_client put them; call it before anything observes a metric"
        )
    if multiprocess_dir is None:
        _chosen = values.MutexValue
        return
    _directory = str(multiprocess_dir)
    # prometheus_client names each process's files from this variable; the workers inherit it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _directory
    _chosen = values.MultiProcessValue()  # type: ignore[no-untyped-call]  # untyped upstream


Metric = TypeVar("Metric", Counter, Gauge, Histogram)
# The children the request path asks for, by metric and label values. prometheus_client's
# `labels()` checks the values and takes a lock on every call, for the same few children on
# every request. This holds the children the metric itself keeps for ever, no more of them.
_children: dict[tuple[object, tuple[str, ...]], Any] = {}


def labelled(metric: Metric, *label_values: str) -> Metric:
    """`metric.labels(*label_values)`, looked up once."""
    key = (metric, label_values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*label_values)
    return cast(Metric, child)


def require_setup() -> None:
    """For the gateway's runtime: refuse to serve with metrics nobody set up."""
    if _chosen is None:
        raise MetricsNotSetUp(
            "oncegate.telemetry.metrics.setup() was not called: the process that runs the gateway "
            "calls it first (with --workers, with the directory the workers share)"
        )


# Why a request with a known key did not reach the upstream (`outcomes.BlockReason`).
BLOCK_REASONS = outcomes.BLOCK_REASONS

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
    "Time of one store operation, from the call to its outcome (its wait for a statement, "
    "the statement and its commit), by operation.",
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
STORE_STALLED_BATCHES = Counter(
    "oncegate_store_stalled_batches_total",
    "Store statements sent beside one of their kind that had not returned within the stall "
    "time (50 ms: stuck on a row lock, a slow disk, or a database short of CPU), carrying what "
    "had queued behind it, by operation.",
    ["operation"],
)
INFLIGHT = Gauge(
    "oncegate_inflight_requests",
    "Requests being forwarded upstream right now.",
    ["route"],
    multiprocess_mode="livesum",  # with --workers: the sum over the live worker processes
)
WAIT_DURATION = Histogram(
    "oncegate_wait_duration_seconds",
    "Time a request spent waiting for its key to settle (Prefer: wait, or the route's wait).",
    ["route"],
    buckets=_REQUEST_BUCKETS,
)
WAITS_REFUSED = Counter(
    "oncegate_waits_refused_total",
    "Duplicates of a key in flight answered 409 at once instead of waiting, because "
    "max_waiters or max_waiters_per_key was reached.",
    ["route"],
)
RESOLUTIONS = Counter(
    "oncegate_resolutions_total",
    "Operators' resolutions of unknown keys, by action (complete, release, resend) and result "
    "(done; for resend, the forward's outcome: forwarded, released, unknown, "
    "upstream_unavailable, store_unavailable; "
    "refused: the key was not unknown or its request not kept).",
    ["action", "result"],
)
KEYS_PURGED = Counter(
    "oncegate_keys_purged_total",
    "Expired keys deleted by the purger.",
)

KEYS = Gauge(
    "oncegate_keys",
    "Keys in the store by state, counted every key_count_interval by a sweep of the table "
    "that one gateway process per database runs and announces to every other; the same "
    "database-wide figure from every gateway.",
    ["state"],
    # Every worker shows the same announced totals: the freshest is the one to show, not a sum.
    multiprocess_mode="livemostrecent",
)

FAILOVER_UNSAFE = Gauge(
    "oncegate_store_failover_unsafe",
    "1 when PostgreSQL has streaming standbys but none synchronous, or commits with "
    "synchronous_commit below on: a failover can lose acknowledged claims, so a retry after it "
    "could be performed twice (checked at start-up, by /readyz and with every key count).",
    multiprocess_mode="livemostrecent",
)


def exposition() -> bytes:
    """The text for `/metrics`: this process's metrics, or with --workers every worker's."""
    if _directory:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=_directory)  # type: ignore[no-untyped-call]  # untyped upstream
        return generate_latest(registry)
    return generate_latest()


def mark_process_dead(pid: int) -> None:
    """A worker ended (--workers): its live gauges stop counting it."""
    if _directory:
        multiprocess.mark_process_dead(pid, path=_directory)  # type: ignore[no-untyped-call]  # untyped upstream
