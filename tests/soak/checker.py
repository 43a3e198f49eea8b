"""The history checker: reads what the clients saw, what the upstream performed and what the key
table holds after the chaos, and lists every way they contradict the contract's promises.

The rules, each with the name a report counts it under:

1. `duplicate`: no (route, tenant, key) was performed twice by the upstream, except on routes with
   `on_unknown: forward`, whose re-forwards must still carry the key; and no single client
   request reached the upstream twice (`sent-twice`). A request the gateway refused or answered
   from the store (a replay, 409, 422, 503 `store-unavailable`, ...) reached the upstream zero
   times (`refused-but-sent`).
2. `wrong-answer`: every answer a client got from the upstream, replayed or not, is the answer the
   upstream gave to a request of that key with the same body; a replay is of a stored answer
   (never of a released 429/503, never of a reset), and a fresh one is the answer to this very
   request. `answer-changed`: two replays of one key replay the same answer, unless PostgreSQL
   crashed between them (only a crash can take a stored answer away; then a forward route may
   forward the key again and store another).
3. `cross-scope`: no client was ever answered with another route's, tenant's or key's answer.
4. `off-contract`: every answer the gateway made itself is one of the contract's problems, with
   its status, `title` and `detail`; every other answer is the upstream's. No 500, no bare text.
5. `lost`: a key whose client saw a stored answer (or that the upstream performed) is, after the
   chaos, in the key table: completed with one of the answers the upstream gave it, or `unknown`
   (an answer lost with PostgreSQL, or a gateway that died mid-flight); never absent.
6. `held`: no key is still `in_progress` once the chaos has stopped and every lease has run out,
   and no probe sent after that is answered 409 `request-in-progress`.
7. `unexplained-unknown`: every key that ends `unknown` was in flight at a failure: the
   upstream answered one of its requests late or reset it, the route's timeout fired on one
   (the gateway's 504 `outcome-unknown`: the upstream ran late without being told to), a
   request of it was in flight in a gateway when that gateway was signalled, or in flight (or
   answered just before) when its own store failed (a crash, a stop, a failover, a Citus worker
   stopped, a shard moved). Each is counted under its cause (`Result.unknown_causes`).

A run may have several stores (scenarios): a store's events name it as their `target`, and a key
is judged against the events of the store its requests went to (`Attempt.scenario`); events with
no target (histories of a single store) concern every key.

The checker is a pure function of the four histories (`check`), so its tests feed it hand-made
ones, one per violation.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.soak.history import UPSTREAM_MARK, Attempt, Event, Performed, Row

PROBLEM = "application/problem+json"
PROBLEM_PREFIX = "urn:oncegate:problem:"
# The contract's table (section 4): every problem the proxy may answer, and its statuses.
# Written out here rather than taken from the gateway's own code, so the check is independent.
CONTRACT_PROBLEMS: dict[str, frozenset[int]] = {
    "missing-key": frozenset({400}),
    "invalid-key": frozenset({400}),
    "invalid-path": frozenset({400}),
    "body-too-large": frozenset({413}),
    "route-not-found": frozenset({404}),
    "response-not-stored": frozenset({409}),
    "request-in-progress": frozenset({409}),
    "key-reused": frozenset({422}),
    "upstream-unavailable": frozenset({502}),
    "outcome-unknown": frozenset({409, 502, 504}),
    "store-unavailable": frozenset({503}),
    "answer-sealed": frozenset({503}),
    # The edge's refusals the contract leaves to the gateway (docs/security.md, "Decisions").
    "invalid-header": frozenset({400}),
    "invalid-request": frozenset({400}),
    "unsupported-transfer-coding": frozenset({501}),
    "request-timeout": frozenset({408}),
}
# The one gateway answer that may follow a request that reached the upstream: the first caller's
# 502/504 `outcome-unknown`. Every other problem means "not forwarded" (`upstream-unavailable`
# too: it says nothing was sent).
FORWARDED_PROBLEM = ("outcome-unknown", frozenset({502, 504}))
RELEASE_STATUSES = frozenset({429, 503})
ROWS_READ = "key-table-read"  # the event that says when the key table was read
# The faults that can lose an answer PostgreSQL acknowledged without flushing it (the store
# commits answers with synchronous_commit off by default): a crash, or a failover to a standby
# the answer had not reached; a clean `stop -m fast` flushes everything first.
CRASHES = frozenset(
    {"postgres-kill", "postgres-immediate", "postgres-failover", "citus-worker-stop"}
)
# Every failure of a store, and the event that ends it: the store is back (restarted, its standby
# promoted, the worker started, the shard in its new place).
STORE_FAULTS = {
    "postgres-fast": "postgres-start",
    "postgres-immediate": "postgres-start",
    "postgres-kill": "postgres-start",
    "postgres-failover": "postgres-promoted",
    "citus-worker-stop": "citus-worker-start",
    "citus-shard-move": "citus-shard-moved",
}
GATEWAY_FAULTS = frozenset({"gateway-kill", "gateway-term", "gateway-pause"})
# The upstream's faults whose outcome the gateway cannot know: answered after the route timeout
# (504), or the connection reset after the request was read (502).
UPSTREAM_UNKNOWN = frozenset({"slow", "reset"})
# A store failure may take with it an answer acknowledged shortly before (committed without
# waiting for the WAL flush, or not yet on the standby), and the gateways' pools meet its
# closed connections for a moment after it is back.
LOSS_BEFORE = 3.0
AFTER_RECOVERY = 5.0
# A request whose client hung up stays in its gateway (the claim may wait for the store up to its
# timeouts, then the forward): in flight this long after the hang-up.
AFTER_HANG_UP = 25.0
SLACK = 0.5  # between the driver's clock readings of an event and of a request
RULES = (
    "duplicate",
    "sent-twice",
    "refused-but-sent",
    "wrong-answer",
    "answer-changed",
    "cross-scope",
    "off-contract",
    "lost",
    "held",
    "unexplained-unknown",
)

Identity = tuple[str, str, str]  # route, tenant, key


@dataclass(frozen=True)
class Violation:
    rule: str
    identity: Identity
    what: str
    timeline: tuple[str, ...] = ()

    def report(self) -> str:
        route, tenant, key = self.identity
        lines = [f"[{self.rule}] route={route} tenant={tenant!r} key={key!r}: {self.what}"]
        lines += [f"    {line}" for line in self.timeline]
        return "\n".join(lines)


@dataclass
class Result:
    violations: list[Violation] = field(default_factory=list)
    # Each `unknown` key counted once, under the first failure found around it.
    unknown_causes: collections.Counter[str] = field(default_factory=collections.Counter)

    def count(self, rule: str) -> int:
        return sum(1 for violation in self.violations if violation.rule == rule)

    @property
    def unexpected_5xx(self) -> int:
        return sum(
            1
            for violation in self.violations
            if violation.rule == "off-contract" and violation.what.startswith("5")
        )

    @property
    def ok(self) -> bool:
        return not self.violations


@dataclass(frozen=True)
class UpstreamAnswer:
    """What an answer's body says about the upstream request that produced it."""

    serial: int
    attempt: str | None
    identity: Identity


def upstream_answer(text: str | None) -> UpstreamAnswer | None:
    """The upstream's signature in an answer's body, or None if the upstream did not write it."""
    try:
        document = json.loads(text or "")
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("mark") != UPSTREAM_MARK:
        return None
    identity = (str(document["route"]), str(document["tenant"]), str(document["key"]))
    return UpstreamAnswer(int(document["serial"]), document.get("attempt"), identity)


def problem_name(attempt: Attempt) -> str | None:
    """The problem a gateway-made answer names, when it is a well-formed one of the contract."""
    if attempt.content_type != PROBLEM:
        return None
    try:
        document: Any = json.loads(attempt.answer or "")
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    name = str(document.get("type", "")).removeprefix(PROBLEM_PREFIX)
    well_formed = (
        str(document.get("type", "")).startswith(PROBLEM_PREFIX)
        and document.get("status") == attempt.status
        and bool(document.get("title"))
        and bool(document.get("detail"))
        and attempt.status in CONTRACT_PROBLEMS.get(name, frozenset())
    )
    return name if well_formed else None


def identity(record: Attempt | Performed | Row) -> Identity:
    return (record.route, record.tenant, record.key or "")


class _Checker:
    def __init__(
        self,
        attempts: Sequence[Attempt],
        performed: Sequence[Performed],
        rows: Sequence[Row],
        events: Sequence[Event],
        forward_routes: Iterable[str],
    ) -> None:
        routes = {attempt.route for attempt in attempts}
        self.attempts = attempts
        # Only the soak's own routes: the fuzzer's requests reach the same upstream.
        self.performed = [record for record in performed if record.route in routes]
        self.events = sorted(events, key=lambda event: event.at)
        self.forward_routes = frozenset(forward_routes)
        self.by_serial = {record.serial: record for record in self.performed}
        self.by_attempt: dict[str, list[Performed]] = collections.defaultdict(list)
        self.by_key: dict[Identity, list[Performed]] = collections.defaultdict(list)
        sent_by = {attempt.attempt: attempt for attempt in attempts}
        for record in self.performed:
            if record.attempt is not None:
                self.by_attempt[record.attempt].append(record)
            # Filed under the key its client sent, not the one the upstream got: they must agree.
            client = sent_by.get(record.attempt or "")
            self.by_key[identity(client or record)].append(record)
        self.attempts_by_key: dict[Identity, list[Attempt]] = collections.defaultdict(list)
        for attempt in attempts:
            self.attempts_by_key[identity(attempt)].append(attempt)
        # When each gateway was signalled, in order, with what.
        self.gateway_faults: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
        for event in self.events:
            if event.what in GATEWAY_FAULTS:
                self.gateway_faults[event.target].append((event.at, event.what))
        self.store_faults = store_faults(self.events)
        self.rows = {identity(row): row for row in rows}
        # The key table was read once the chaos had settled; what came later (the probes) is not
        # in it.
        self.rows_read_at = min(
            (event.at for event in events if event.what == ROWS_READ), default=float("inf")
        )
        times = [attempt.sent for attempt in attempts] + [record.received for record in performed]
        self.origin = min(times, default=0.0)
        self.result = Result()
        # Replays of a stored answer that passed every other check, by key: (attempt, serial).
        self.replays: dict[Identity, list[tuple[Attempt, int]]] = collections.defaultdict(list)

    def violation(self, rule: str, key: Identity, what: str) -> None:
        self.result.violations.append(Violation(rule, key, what, self.timeline(key)))

    def timeline(self, key: Identity) -> tuple[str, ...]:
        """Every request of this key, what the upstream did with it, and the faults around."""
        entries: list[tuple[float, str]] = []
        for attempt in self.attempts_by_key.get(key, []):
            answer = f"{attempt.status} {problem_name(attempt) or ''}".strip()
            if attempt.replayed:
                answer += " replayed"
            fate = answer if attempt.outcome == "answer" else attempt.outcome
            entries.append(
                (
                    attempt.sent,
                    f"{attempt.attempt} via {attempt.gateway or '?'} ({attempt.phase}) body "
                    f"{attempt.body[:60]} -> {fate} after {attempt.ended - attempt.sent:.3f}s",
                )
            )
        for record in self.by_key.get(key, []):
            entries.append(
                (
                    record.received,
                    f"upstream #{record.serial} read {record.attempt}: {record.fault}, "
                    f"{'performed' if record.performed else 'not performed'}, "
                    f"answered {record.status}",
                )
            )
        if entries:
            # Wide enough for the failures an `unknown` key may be explained by.
            start = min(at for at, _ in entries) - LOSS_BEFORE
            end = max(at for at, _ in entries) + AFTER_RECOVERY
            entries += [
                (event.at, f"fault: {event.what} {event.target}")
                for event in self.events
                if start <= event.at <= end
            ]
        row = self.rows.get(key)
        tail = [f"key table: {row.state} {row.status}" if row else "key table: no row"]
        return tuple(
            f"{at - self.origin:9.3f}s {text}"
            for at, text in sorted(entries, key=lambda entry: entry[0])
        ) + tuple(tail)

    def run(self) -> Result:
        for attempt in self.attempts:
            self.check_attempt(attempt)
        self.check_replays_agree()
        self.check_duplicates()
        self.check_rows()
        return self.result

    def check_attempt(self, attempt: Attempt) -> None:
        key = identity(attempt)
        sent = self.by_attempt.get(attempt.attempt, [])
        if len(sent) > 1:
            self.violation(
                "sent-twice", key, f"{attempt.attempt} reached the upstream {len(sent)}x"
            )
        if attempt.outcome != "answer":
            return
        if attempt.content_type == PROBLEM:
            name = problem_name(attempt)
            if name is None:
                self.violation(
                    "off-contract", key, f"{attempt.status} {attempt.answer!r:.200} is no problem "
                    "of the contract with that status",
                )  # fmt: skip
                return
            forwarded = name == FORWARDED_PROBLEM[0] and attempt.status in FORWARDED_PROBLEM[1]
            if sent and not forwarded:
                self.violation(
                    "refused-but-sent", key,
                    f"{attempt.attempt} was answered {attempt.status} {name}, yet the upstream "
                    f"read it (#{sent[0].serial})",
                )  # fmt: skip
            if name == "request-in-progress" and attempt.phase == "probe":
                self.violation("held", key, f"probe {attempt.attempt} answered 409 in progress")
            return
        answer = upstream_answer(attempt.answer)
        if answer is None:
            self.violation(
                "off-contract", key, f"{attempt.status} {attempt.content_type} "
                f"{attempt.answer!r:.200} is neither a problem nor the upstream's answer",
            )  # fmt: skip
            return
        if answer.identity != key:
            self.violation(
                "cross-scope", key,
                f"{attempt.attempt} got the answer #{answer.serial} made for {answer.identity}",
            )  # fmt: skip
            return
        record = self.by_serial.get(answer.serial)
        if record is None or (record.status, record.answer) != (attempt.status, attempt.answer):
            self.violation(
                "wrong-answer", key,
                f"{attempt.attempt} got {attempt.status} #{answer.serial}, which the upstream "
                "never answered so",
            )  # fmt: skip
            return
        if record.body != attempt.body:
            self.violation(
                "wrong-answer", key,
                f"{attempt.attempt} sent body {attempt.body[:80]} and got the answer to "
                f"{record.body[:80]} (#{record.serial}): a reused key must be refused",
            )  # fmt: skip
            return
        if attempt.replayed:
            if sent:
                self.violation(
                    "refused-but-sent", key, f"{attempt.attempt} was a replay, yet the upstream "
                    f"read it (#{sent[0].serial})",
                )  # fmt: skip
            if not record.performed or record.status in RELEASE_STATUSES:
                self.violation(
                    "wrong-answer", key,
                    f"{attempt.attempt} got a replay of #{record.serial}, an answer that must "
                    "not be stored",
                )  # fmt: skip
            else:
                self.replays[key].append((attempt, record.serial))
        elif record.attempt != attempt.attempt:
            self.violation(
                "wrong-answer", key,
                f"{attempt.attempt} got #{record.serial}, the answer to {record.attempt}, "
                "without Idempotent-Replayed",
            )  # fmt: skip

    def scenario(self, key: Identity) -> str:
        attempts = self.attempts_by_key.get(key)
        return attempts[0].scenario if attempts else ""

    def check_replays_agree(self) -> None:
        for key, replays in self.replays.items():
            scenario = self.scenario(key)
            crashes = [
                event.at for event in self.events
                if event.what in CRASHES and event.target in ("", scenario)
            ]  # fmt: skip
            ordered = sorted(replays, key=lambda replay: replay[0].ended)
            for (earlier, before), (later, after) in itertools.pairwise(ordered):
                if before == after:
                    continue
                # The earlier replay read the answer between its sending and its end; a crash
                # that lost it came after that read (one second of slack between clocks).
                if any(earlier.sent - 1 <= at <= later.ended for at in crashes):
                    continue
                self.violation(
                    "answer-changed", key,
                    f"{earlier.attempt} was replayed #{before}, then {later.attempt} #{after}, "
                    "with no PostgreSQL crash between",
                )  # fmt: skip

    def check_duplicates(self) -> None:
        for key, records in self.by_key.items():
            done = [record for record in records if record.performed]
            if not done:
                continue
            if any(record.key != key[2] for record in done):
                self.violation("duplicate", key, "forwarded without its Idempotency-Key")
            if len(done) > 1 and key[0] not in self.forward_routes:
                serials = ", ".join(f"#{record.serial}" for record in done)
                self.violation("duplicate", key, f"performed {len(done)} times ({serials})")

    def released_last(self, key: Identity) -> bool:
        """On a route that forwards `unknown` keys again, the last forward may be refused with a
        release status, which deletes the row whatever came before."""
        records = [
            record for record in self.by_key.get(key, []) if record.received < self.rows_read_at
        ]
        return (
            key[0] in self.forward_routes
            and bool(records)
            and max(records, key=lambda record: record.serial).status in RELEASE_STATUSES
        )

    def check_rows(self) -> None:
        answered = {
            key
            for key, attempts in self.attempts_by_key.items()
            for attempt in attempts
            if attempt.outcome == "answer"
            and attempt.ended < self.rows_read_at
            and attempt.content_type != PROBLEM
            and attempt.status not in RELEASE_STATUSES
            and (found := upstream_answer(attempt.answer)) is not None
            and found.identity == key
        }
        performed = {
            key
            for key, records in self.by_key.items()
            if any(record.performed and record.received < self.rows_read_at for record in records)
        }
        for key in sorted(answered | performed):
            row = self.rows.get(key)
            if row is None and self.released_last(key):
                continue  # `on_unknown: forward`: taken over, then released by a 429/503
            if row is None:
                seen = "a client saw its answer" if key in answered else "the upstream performed it"
                self.violation("lost", key, f"{seen}, and the key table has no row for it")
                continue
            if row.state != "completed":
                continue
            answers = {
                (record.status, record.answer) for record in self.by_key.get(key, [])
                if record.performed
            }  # fmt: skip
            if (row.status, row.answer) not in answers and not (
                not row.stored and row.status in {status for status, _ in answers}
            ):
                self.violation(
                    "lost", key, f"stored {row.status} {row.answer!r:.120}, an answer the upstream "
                    "never gave this key",
                )  # fmt: skip
        for key, row in self.rows.items():
            if row.state == "in_progress":
                self.violation("held", key, "still in progress after the chaos and every lease")
            if row.state == "unknown":
                cause = self.unknown_cause(key, row)
                if cause is None:
                    self.violation(
                        "unexplained-unknown", key,
                        "unknown, yet no request of it was in flight at a failure",
                    )  # fmt: skip
                else:
                    self.result.unknown_causes[cause] += 1

    def unknown_cause(self, key: Identity, row: Row) -> str | None:
        """The failure a key's requests were in flight at (`upstream-slow`, `gateway-kill`,
        `postgres-failover`, ...), or None."""
        for record in self.by_key.get(key, []):
            if record.fault in UPSTREAM_UNKNOWN:
                return f"upstream-{record.fault}"
        for attempt in self.attempts_by_key.get(key, []):
            # The route's timeout fired before the upstream's answer came back, though the
            # upstream drew no fault: on a loaded machine it (or the gateway reading it) ran late.
            if attempt.status == 504 and problem_name(attempt) == "outcome-unknown":
                return "route-timeout"
        # The same, where the 504 went to a client that had hung up: the gateway's own record of
        # why it marked the key says its timeout fired.
        if row.failure == "read_timeout":
            return "route-timeout"
        attempts = [
            attempt for attempt in self.attempts_by_key.get(key, [])
            if attempt.sent < self.rows_read_at
        ]  # fmt: skip
        for attempt in attempts:
            begin, end = in_flight(attempt)
            signals = self.gateway_faults.get(attempt.gateway, [])
            first = bisect.bisect_left(signals, (begin - SLACK,))
            if first < len(signals) and signals[first][0] <= end + SLACK:
                return signals[first][1]
        for attempt in attempts:
            begin, end = in_flight(attempt)
            for fault in self.store_faults:
                if fault.target in ("", attempt.scenario) and (
                    fault.began - LOSS_BEFORE <= end and begin <= fault.ended + AFTER_RECOVERY
                ):
                    return fault.what
        return None


@dataclass(frozen=True)
class StoreFault:
    what: str
    target: str
    began: float
    ended: float  # when the store was back; infinity if it never was


def store_faults(events: Sequence[Event]) -> list[StoreFault]:
    """Each store failure with its end: the next recovery event of the same store."""
    faults = []
    for index, event in enumerate(events):
        recovery = STORE_FAULTS.get(event.what)
        if recovery is None:
            continue
        ended = next(
            (later.at for later in events[index + 1 :]
             if later.what == recovery and later.target == event.target),
            float("inf"),
        )  # fmt: skip
        faults.append(StoreFault(event.what, event.target, event.at, ended))
    return faults


def in_flight(attempt: Attempt) -> tuple[float, float]:
    """When a request may have been at work in its gateway: from its sending until its answer,
    or, when its client hung up, until long after (the gateway carries on without it)."""
    if attempt.outcome == "hung-up":
        return attempt.sent, attempt.ended + AFTER_HANG_UP
    return attempt.sent, attempt.ended


def check(
    attempts: Sequence[Attempt],
    performed: Sequence[Performed],
    rows: Sequence[Row],
    events: Sequence[Event] = (),
    forward_routes: Iterable[str] = (),
) -> Result:
    """Every violation of the rules above in one run's histories."""
    return _Checker(attempts, performed, rows, events, forward_routes).run()


def check_fuzz(
    results: Sequence[dict[str, Any]], stored: Iterable[str], requested: int
) -> list[str]:
    """The fuzzer's own verdicts (5xx outside the contract, hangs), that it sent all it was asked
    to, and that no row of the fuzzing gateway's key table belongs to a request it refused: every
    stored key was sent by at least one request that was accepted."""
    violations = [str(result["violation"]) for result in results if result["violation"]]
    if len(results) < requested:
        violations.append(f"the fuzzer sent {len(results)} of its {requested} requests")
    accepted = {result["key"] for result in results if not result["refused"] and result["key"]}
    violations += [
        f"a row for key {key!r}, which only refused requests sent"
        for key in stored
        if key not in accepted
    ]
    return violations
