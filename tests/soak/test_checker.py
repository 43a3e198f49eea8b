"""The checker on hand-made histories: a clean one passes, and each kind of violation the soak
looks for is caught, under its rule, naming its key. No processes: the checker is pure."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.soak import checker
from tests.soak.history import UPSTREAM_MARK, Attempt, Event, Performed, Row

ROUTE, TENANT, KEY = "mail", "Bearer alpha", "key-1"
BODY = '{"n": 1}'


def receipt(serial: int, attempt: str, status: int = 201, tenant: str = TENANT) -> str:
    return json.dumps(
        {"mark": UPSTREAM_MARK, "serial": serial, "attempt": attempt, "route": ROUTE,
         "tenant": tenant, "key": KEY, "status": status}
    )  # fmt: skip


def performed(serial: int, attempt: str, status: int | None = 201, **changes: object) -> Performed:
    fault = {201: "answer", 500: "error500", 429: "429", 503: "503", None: "reset"}[status]
    record = Performed(
        serial=serial, attempt=attempt, route=ROUTE, tenant=TENANT, key=KEY, body=BODY,
        received=100.0 + serial, fault=fault, performed=status not in (429, 503), status=status,
        answer=None if status is None else receipt(serial, attempt, status),
    )  # fmt: skip
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def attempt(name: str, at: float, **changes: object) -> Attempt:
    record = Attempt(
        attempt=name, route=ROUTE, tenant=TENANT, key=KEY, body=BODY, sent=at, ended=at + 0.01,
        outcome="answer",
    )  # fmt: skip
    return dataclasses.replace(record, **changes)  # type: ignore[arg-type]


def answered(
    name: str, at: float, serial: int, replayed: bool = False, **changes: object
) -> Attempt:
    """An attempt that got the upstream's answer #serial (to attempt `a1` unless said)."""
    source = str(changes.pop("source", "a1"))
    return attempt(
        name, at, **{"status": 201, "content_type": "application/json", "replayed": replayed,
                      "answer": receipt(serial, source), **changes},
    )  # fmt: skip


def problem(name: str, at: float, problem_type: str, status: int, **changes: object) -> Attempt:
    document = {"type": f"urn:oncegate:problem:{problem_type}", "title": "t", "status": status,
                "detail": "d"}  # fmt: skip
    return attempt(
        name, at, status=status, content_type="application/problem+json",
        answer=json.dumps(document), **changes,
    )  # fmt: skip


def completed(serial: int = 1, attempt_name: str = "a1", **changes: object) -> Row:
    row = Row(route=ROUTE, tenant=TENANT, key=KEY, state="completed", status=201,
              answer=receipt(serial, attempt_name), stored=True)  # fmt: skip
    return dataclasses.replace(row, **changes)  # type: ignore[arg-type]


READ = Event(1000.0, checker.ROWS_READ)


def clean() -> tuple[list[Attempt], list[Performed], list[Row]]:
    """A key forwarded once, then replayed, refused while in flight, refused as reused, refused
    while the store was down; the key table holds the answer."""
    attempts = [
        answered("a1", 100.0, 1),
        problem("a2", 100.5, "request-in-progress", 409),
        answered("a3", 102.0, 1, replayed=True),
        problem("a4", 103.0, "key-reused", 422, body='{"n": 2}'),
        problem("a5", 104.0, "store-unavailable", 503),
        attempt("a6", 105.0, outcome="no-answer"),
    ]
    return attempts, [performed(1, "a1")], [completed()]


def rules(result: checker.Result) -> list[str]:
    return sorted(violation.rule for violation in result.violations)


def test_a_clean_history_passes() -> None:
    attempts, upstream, rows = clean()
    result = checker.check(attempts, upstream, rows, [READ])
    assert result.ok, [violation.report() for violation in result.violations]


def test_a_key_performed_twice_is_a_duplicate_with_its_timeline() -> None:
    attempts, upstream, rows = clean()
    attempts.append(answered("a7", 106.0, 2, source="a7"))
    upstream.append(performed(2, "a7"))
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["duplicate"]
    violation = result.violations[0]
    assert violation.identity == (ROUTE, TENANT, KEY)
    assert "performed 2 times (#1, #2)" in violation.what
    report = violation.report()
    assert "upstream #1 read a1" in report and "upstream #2 read a7" in report


def test_a_forward_route_may_perform_a_key_again_but_only_with_its_key() -> None:
    attempts, upstream, rows = clean()
    upstream.append(performed(2, "a6"))
    assert checker.check(attempts, upstream, rows, [READ], forward_routes={ROUTE}).ok
    attempts.append(attempt("a8", 107.0, outcome="no-answer"))
    upstream.append(performed(3, "a8", key=None))  # the gateway dropped the client's key
    result = checker.check(attempts, upstream, rows, [READ], forward_routes={ROUTE})
    assert rules(result) == ["duplicate"]
    assert "without its Idempotency-Key" in result.violations[0].what


def test_one_request_sent_upstream_twice_is_caught() -> None:
    attempts, upstream, rows = clean()
    upstream.append(performed(2, "a1", status=429))
    result = checker.check(attempts, upstream, rows, [READ], forward_routes={ROUTE})
    assert rules(result) == ["sent-twice"]


@pytest.mark.parametrize(
    "refused", ["a2", "a4", "a5", "a7"], ids=["in-progress", "reused", "store-down", "not-sent"]
)
def test_a_refused_request_that_reached_the_upstream_is_caught(refused: str) -> None:
    attempts, upstream, rows = clean()
    attempts.append(problem("a7", 106.0, "upstream-unavailable", 502))
    upstream.append(performed(2, refused, status=503))
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["refused-but-sent"]


def test_a_replay_that_reached_the_upstream_is_caught() -> None:
    attempts, upstream, rows = clean()
    upstream.append(performed(2, "a3", status=429))
    assert rules(checker.check(attempts, upstream, rows, [READ])) == ["refused-but-sent"]


def test_a_replay_that_differs_from_the_upstreams_answer_is_caught() -> None:
    attempts, upstream, rows = clean()
    attempts[2] = dataclasses.replace(attempts[2], status=200)
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["wrong-answer"]
    assert "never answered so" in result.violations[0].what


def changed_replays() -> tuple[list[Attempt], list[Performed], list[Row]]:
    """Key `key-1` on a forward route: replayed #1, then forwarded again (#2) and replayed #2."""
    attempts, upstream, _ = clean()
    upstream.append(performed(2, "a6"))
    attempts.append(answered("a7", 110.0, 2, replayed=True, source="a6"))
    return attempts, upstream, [completed(2, "a6")]


def test_a_stored_answer_that_changes_between_two_replays_is_caught() -> None:
    attempts, upstream, rows = changed_replays()
    result = checker.check(attempts, upstream, rows, [READ], forward_routes={ROUTE})
    assert rules(result) == ["answer-changed"]
    assert "replayed #1, then a7 #2" in result.violations[0].what


@pytest.mark.parametrize(
    ("fault", "at", "allowed"),
    [("postgres-kill", 105.0, True), ("postgres-immediate", 108.0, True),
     ("postgres-failover", 105.0, True),
     ("postgres-fast", 105.0, False), ("postgres-kill", 100.0, False)],
    ids=["kill-between", "immediate-between", "failover-between", "clean-stop",
         "kill-before-the-first-replay"],
)  # fmt: skip
def test_only_a_postgres_crash_between_two_replays_may_change_the_answer(
    fault: str, at: float, allowed: bool
) -> None:
    attempts, upstream, rows = changed_replays()
    events = [READ, Event(at, fault)]
    result = checker.check(attempts, upstream, rows, events, forward_routes={ROUTE})
    assert result.ok == allowed


def test_only_a_crash_of_the_keys_own_store_may_change_its_answer() -> None:
    attempts, upstream, rows = changed_replays()
    attempts = [dataclasses.replace(attempt, scenario="failover") for attempt in attempts]
    events = [READ, Event(105.0, "citus-worker-stop", "citus")]
    result = checker.check(attempts, upstream, rows, events, forward_routes={ROUTE})
    assert rules(result) == ["answer-changed"]
    events = [READ, Event(105.0, "postgres-failover", "failover")]
    assert checker.check(attempts, upstream, rows, events, forward_routes={ROUTE}).ok


def test_a_replay_to_a_different_body_is_caught() -> None:
    attempts, upstream, rows = clean()
    attempts[3] = answered("a4", 103.0, 1, replayed=True, body='{"n": 2}')
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["wrong-answer"]
    assert "a reused key must be refused" in result.violations[0].what


def test_a_replay_of_a_released_answer_is_caught() -> None:
    attempts, upstream, rows = clean()
    upstream.append(performed(2, "a6", status=429))
    attempts.append(
        attempt("a7", 107.0, status=429, content_type="application/json", replayed=True,
                answer=receipt(2, "a6", 429))
    )  # fmt: skip
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["wrong-answer"]
    assert "must not be stored" in result.violations[0].what


def test_another_requests_answer_without_the_replay_header_is_caught() -> None:
    attempts, upstream, rows = clean()
    attempts[2] = dataclasses.replace(attempts[2], replayed=False)
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["wrong-answer"]
    assert "without Idempotent-Replayed" in result.violations[0].what


def test_an_answer_made_for_another_scope_is_caught() -> None:
    attempts, upstream, rows = clean()
    other = "Bearer beta"
    upstream.append(performed(2, "b1", tenant=other, answer=receipt(2, "b1", tenant=other)))
    rows.append(completed(2, "b1", tenant=other, answer=receipt(2, "b1", tenant=other)))
    attempts.append(
        answered("b1", 106.0, 2, source="b1", tenant=other, answer=receipt(2, "b1", tenant=other))
    )
    # The same key, tenant alpha, answered with tenant beta's stored answer.
    attempts.append(answered("a8", 107.0, 2, replayed=True, answer=receipt(2, "b1", tenant=other)))
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["cross-scope"]
    assert result.violations[0].identity == (ROUTE, TENANT, KEY)


@pytest.mark.parametrize(
    ("status", "content_type", "answer"),
    [
        (500, "text/plain; charset=utf-8", "Internal Server Error"),
        (500, "application/problem+json",
         '{"type": "urn:oncegate:problem:store-unavailable", "title": "t", "status": 500, '
         '"detail": "d"}'),
        (503, "application/problem+json",
         '{"type": "urn:oncegate:problem:made-up", "title": "t", "status": 503, "detail": "d"}'),
        (409, "application/problem+json",
         '{"type": "urn:oncegate:problem:request-in-progress", "title": "t", "status": 409}'),
        (201, "application/json", '{"not": "the upstream"}'),
    ],
    ids=["bare-500", "problem-with-wrong-status", "unknown-problem", "no-detail", "made-up-201"],
)  # fmt: skip
def test_an_answer_outside_the_contract_is_caught(
    status: int, content_type: str, answer: str
) -> None:
    attempts, upstream, rows = clean()
    attempts.append(attempt("a7", 107.0, status=status, content_type=content_type, answer=answer))
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["off-contract"]
    assert result.unexpected_5xx == (1 if status >= 500 else 0)


def test_a_key_whose_answer_a_client_saw_must_not_vanish() -> None:
    attempts, upstream, _ = clean()
    result = checker.check(attempts, upstream, [], [READ])
    assert rules(result) == ["lost"]
    assert "a client saw its answer" in result.violations[0].what


def test_a_performed_key_must_not_vanish_even_if_no_client_saw_it() -> None:
    attempts = [attempt("a1", 100.0, outcome="no-answer")]
    result = checker.check(attempts, [performed(1, "a1", status=None)], [], [READ])
    assert rules(result) == ["lost"]
    assert "the upstream performed it" in result.violations[0].what


def test_a_stored_answer_the_upstream_never_gave_is_caught() -> None:
    attempts, upstream, _ = clean()
    rows = [completed(answer=receipt(9, "a9"))]
    assert rules(checker.check(attempts, upstream, rows, [READ])) == ["lost"]


UNKNOWN = completed(state="unknown", status=None, answer=None, stored=False)


def test_unknown_is_an_allowed_end_for_an_answered_key() -> None:
    """An answer committed asynchronously and lost with PostgreSQL leaves the claim, whose lease
    runs out: `unknown`, never forwarded again."""
    attempts, upstream, _ = clean()
    crash = [Event(101.0, "postgres-kill"), Event(103.0, "postgres-start")]
    result = checker.check(attempts, upstream, [UNKNOWN], [READ, *crash])
    assert result.ok, [violation.report() for violation in result.violations]
    assert result.unknown_causes == {"postgres-kill": 1}


def test_an_unknown_key_with_no_failure_around_it_is_caught() -> None:
    attempts, upstream, _ = clean()
    result = checker.check(attempts, upstream, [UNKNOWN], [READ])
    assert rules(result) == ["unexplained-unknown"]
    assert result.violations[0].timeline[-1] == "key table: unknown None"


@pytest.mark.parametrize("fault", ["slow", "reset"])
def test_an_upstream_timeout_or_reset_explains_unknown(fault: str) -> None:
    attempts, upstream, _ = clean()
    upstream = [dataclasses.replace(upstream[0], fault=fault)]
    result = checker.check(attempts, upstream, [UNKNOWN], [READ])
    assert result.ok and result.unknown_causes == {f"upstream-{fault}": 1}


def test_a_route_timeout_explains_unknown_though_the_upstream_drew_no_fault() -> None:
    """On a loaded machine the upstream can answer after the route's timeout unasked: the
    gateway's first answer, 504 `outcome-unknown`, says its timeout fired."""
    attempts = [problem("a1", 100.0, "outcome-unknown", 504)]
    result = checker.check(attempts, [performed(1, "a1")], [UNKNOWN], [READ])
    assert result.ok and result.unknown_causes == {"route-timeout": 1}
    attempts = [problem("a1", 100.0, "outcome-unknown", 502)]  # a 502 is no timeout
    assert rules(checker.check(attempts, [performed(1, "a1")], [UNKNOWN], [READ])) == [
        "unexplained-unknown"
    ]


@pytest.mark.parametrize(
    ("failure", "explained"),
    [("read_timeout", True), ("no_answer", False), ("answer_broken", False), (None, False)],
)
def test_a_route_timeout_whose_504_nobody_saw_is_read_from_the_key_table(
    failure: str | None, explained: bool
) -> None:
    """The client hung up before the gateway's 504: only the gateway's record of why it marked
    the key `unknown` says its timeout fired. Another reason, or none, explains nothing."""
    attempts = [attempt("a1", 100.0, outcome="hung-up", gateway="gateway-1")]
    row = dataclasses.replace(UNKNOWN, failure=failure)
    result = checker.check(attempts, [performed(1, "a1")], [row], [READ])
    assert result.ok == explained
    assert result.unknown_causes == ({"route-timeout": 1} if explained else {})
    if not explained:
        assert rules(result) == ["unexplained-unknown"]


@pytest.mark.parametrize(
    ("target", "at", "explained"),
    [("gateway-1", 100.005, True), ("gateway-2", 100.005, False), ("gateway-1", 120.0, False)],
    ids=["its-gateway-in-flight", "another-gateway", "its-gateway-later"],
)  # fmt: skip
def test_a_gateway_signalled_with_a_request_in_flight_explains_unknown(
    target: str, at: float, explained: bool
) -> None:
    attempts = [answered("a1", 100.0, 1, gateway="gateway-1")]
    events = [READ, Event(at, "gateway-kill", target)]
    result = checker.check(attempts, [performed(1, "a1")], [UNKNOWN], events)
    assert result.ok == explained
    assert result.unknown_causes == ({"gateway-kill": 1} if explained else {})


def test_a_request_whose_client_hung_up_stays_in_flight_in_its_gateway() -> None:
    attempts = [attempt("a1", 100.0, outcome="hung-up", gateway="gateway-1")]
    events = [READ, Event(110.0, "gateway-pause", "gateway-1")]
    assert checker.check(attempts, [performed(1, "a1")], [UNKNOWN], events).ok
    late = [READ, Event(100.0 + checker.AFTER_HANG_UP + 5, "gateway-pause", "gateway-1")]
    assert not checker.check(attempts, [performed(1, "a1")], [UNKNOWN], late).ok


@pytest.mark.parametrize(
    ("events", "explained"),
    [([Event(102.0, "citus-worker-stop", "citus"), Event(104.0, "citus-worker-start", "citus")],
      True),
     ([Event(102.0, "citus-worker-stop", "single"), Event(104.0, "citus-worker-start", "single")],
      False),
     ([Event(90.0, "citus-shard-move", "citus"), Event(99.0, "citus-shard-moved", "citus")],
      True),
     ([Event(80.0, "citus-shard-move", "citus"), Event(90.0, "citus-shard-moved", "citus")],
      False),
     ([Event(90.0, "postgres-failover", "citus"), Event(96.0, "postgres-promoted", "citus")],
      True)],
    ids=["its-store-after-the-answer", "another-store", "during-a-shard-move",
         "a-shard-move-long-before", "a-failover-until-its-promotion"],
)  # fmt: skip
def test_a_failure_of_its_own_store_around_a_request_explains_unknown(
    events: list[Event], explained: bool
) -> None:
    attempts = [answered("a1", 100.0, 1, scenario="citus")]
    result = checker.check(attempts, [performed(1, "a1")], [UNKNOWN], [READ, *events])
    assert result.ok == explained


def test_a_forward_route_key_released_by_its_last_forward_may_have_no_row() -> None:
    attempts, upstream, _ = clean()
    upstream.append(performed(2, "a6", status=503))
    assert checker.check(attempts, upstream, [], [READ], forward_routes={ROUTE}).ok
    assert rules(checker.check(attempts, upstream, [], [READ])) == ["lost"]


def test_what_happened_after_the_key_table_was_read_is_not_expected_in_it() -> None:
    attempts = [answered("probe-1", 2000.0, 1, source="probe-1", phase="probe")]
    upstream = [performed(1, "probe-1", received=2000.0)]
    assert checker.check(attempts, upstream, [], [READ]).ok


def test_a_key_still_in_progress_after_the_chaos_is_held() -> None:
    attempts, upstream, _ = clean()
    rows = [completed(state="in_progress", status=None, answer=None, stored=False)]
    result = checker.check(attempts, upstream, rows, [READ])
    assert rules(result) == ["held"]


def test_a_probe_answered_in_progress_after_the_chaos_is_held() -> None:
    attempts, upstream, rows = clean()
    attempts.append(problem("probe-1", 2000.0, "request-in-progress", 409, phase="probe"))
    assert rules(checker.check(attempts, upstream, rows, [READ])) == ["held"]


def test_an_outcome_unknown_first_answer_may_follow_a_forward() -> None:
    attempts = [problem("a1", 100.0, "outcome-unknown", 502)]
    rows = [completed(state="unknown", status=None, answer=None, stored=False)]
    assert checker.check(attempts, [performed(1, "a1", status=None)], rows, [READ]).ok
    # ... but a retry's 409 `outcome-unknown` never reaches the upstream.
    attempts.append(problem("a2", 101.0, "outcome-unknown", 409))
    upstream = [performed(1, "a1", status=None), performed(2, "a2", status=None)]
    result = checker.check(attempts, upstream, rows, [READ])
    assert "refused-but-sent" in rules(result)


def fuzzed(key: str | None, refused: bool, violation: str | None = None) -> dict[str, object]:
    return {"status": 400 if refused else 201, "refused": refused, "key": key,
            "violation": violation}  # fmt: skip


def test_fuzz_results_pass_when_every_row_belongs_to_an_accepted_request() -> None:
    results = [fuzzed("a", False), fuzzed(None, True), fuzzed("a", True)]
    assert checker.check_fuzz(results, ["a"], 3) == []


def test_fuzz_a_row_left_by_a_refused_request_is_caught() -> None:
    results = [fuzzed("a", False), fuzzed("b", True)]
    assert checker.check_fuzz(results, ["a", "b"], 2) == [
        "a row for key 'b', which only refused requests sent"
    ]


def test_fuzz_verdicts_and_a_short_count_are_reported() -> None:
    results = [fuzzed(None, True, "hang: no answer in 30s to ..."), fuzzed("a", False)]
    assert checker.check_fuzz(results, ["a"], 3) == [
        "hang: no answer in 30s to ...",
        "the fuzzer sent 2 of its 3 requests",
    ]
