"""queries.sql is one dialect: a statement is written once for both servers, and only the
operations that must differ have a shape per server, which the loader keeps apart and refuses
to mix up. (That each server runs its statements is the store suites' work, on both.)"""

from __future__ import annotations

import pytest

from oncegate.store.postgres import workers
from oncegate.store.queries import (
    DIALECTS,
    FRAGMENTS,
    SERVERS,
    load,
    load_dialects,
    load_fragments,
)

# The operations whose work takes another shape on Citus: the claim runs as a function on the
# worker, and the purge, the operator's delete and rekey find rows on every shard first; a page
# of the key count is a range of ids, and the table's estimated rows are each shard's statistics.
SHAPED = {"claim", "purge", "admin_delete", "rekey_batch", "rekey_rows", "count_keys",
          "estimated_keys"}  # fmt: skip
# The writes by row, which hold the fragment `rows_of_batch`: on Citus it also names the batch's
# keys and ids (the shard), on plain PostgreSQL the join with the batch alone.
BY_ROW = {"reclaim_expired", "take_over", "complete", "release", "mark_unknown"}
ON_CITUS_ONLY = "k.key = ANY($1) AND k.id = ANY($2) AND "
REQUEST_PATH = {"get", "reclaim_expired", "take_over", "complete", "release", "mark_unknown",
                "mark_waited", "notify"}  # fmt: skip


def test_only_the_operations_that_must_differ_have_a_shape_per_server() -> None:
    postgres, citus = DIALECTS["postgres"], DIALECTS["citus"]
    differ = {name for name in postgres.keys() & citus.keys() if postgres[name] != citus[name]}
    assert differ == SHAPED | BY_ROW
    for name in BY_ROW:  # written once: they differ by the fragment alone
        assert citus[name].sql.replace(ON_CITUS_ONLY, "") == postgres[name].sql, name
        assert citus[name].parameters == postgres[name].parameters, name
    # The Citus purge's first step is its own: plain PostgreSQL locks and deletes in one.
    assert citus.keys() - postgres.keys() == {"purge_candidates"}
    # Every statement of plain PostgreSQL is one Citus has too (a worker's claims and completes
    # in one statement are built at run time, on its shard tables: postgres/workers.py).
    assert postgres.keys() - citus.keys() == set()


def test_every_request_path_write_names_its_keys_and_tests_states_as_citus_runs_them() -> None:
    for name in REQUEST_PATH - {"get", "mark_waited", "notify"}:
        assert "k.key = ANY($1)" in DIALECTS["citus"][name].sql, name  # the shard, on Citus
        sql = DIALECTS["postgres"][name].sql
        # On plain PostgreSQL each row of the batch is looked up by its primary key.
        assert "k.id = given.id AND k.key = given.key" in sql, name
        assert "ANY(" not in sql.partition("WHERE")[2], name
        assert "oncegate_key_state" not in sql, name  # a CASE around now(): Citus refuses it
        assert "make_interval" not in sql, name  # a STABLE function of a column: refused too
        assert "pg_notify" not in sql, name  # would notify on a worker, where nobody listens


def test_a_statement_a_server_has_no_shape_of_is_an_error_never_another_servers() -> None:
    with pytest.raises(KeyError, match="no statement 'purge_candidates' for postgres"):
        DIALECTS["postgres"]["purge_candidates"]
    with pytest.raises(KeyError, match="no statement 'citus_claim' for citus"):
        DIALECTS["citus"]["citus_claim"]


def test_a_name_written_for_every_server_and_shaped_for_one_does_not_load() -> None:
    text = "-- name: get\nSELECT 1;\n-- name: get [citus]\nSELECT 2;\n"
    with pytest.raises(ValueError, match=r"\['get'\] are written for every server and citus"):
        load_dialects(text)


def test_a_shape_for_an_unknown_server_or_twice_for_one_does_not_load() -> None:
    with pytest.raises(ValueError, match="shaped for mysql"):
        load_dialects("-- name: get [mysql]\nSELECT 1;\n")
    with pytest.raises(ValueError, match="written twice for citus"):
        load_dialects("-- name: get [citus]\nSELECT 1;\n-- name: get [citus]\nSELECT 2;\n")


def test_a_file_of_one_dialect_refuses_shapes() -> None:
    with pytest.raises(ValueError, match="written for citus in a file of one dialect"):
        load("-- name: get [citus]\nSELECT 1;\n")


def test_each_server_gets_the_shared_statement_itself() -> None:
    dialects = load_dialects(
        "-- name: get\nSELECT :id;\n-- name: claim [postgres]\nSELECT 1;\n"
        "-- name: claim [citus]\nSELECT :anchor;\n"
    )
    assert [dialects[server]["get"].sql for server in SERVERS] == ["SELECT $1;"] * 2
    assert dialects["postgres"]["claim"].parameters == ()
    assert dialects["citus"]["claim"].parameters == ("anchor",)


def test_a_fragment_is_written_once_and_each_statement_that_names_it_holds_its_text() -> None:
    text = (
        "-- fragment: done\n-- what a settle writes\nstate = 'done', at = now()\n\n"
        "-- name: settle\nUPDATE t SET {done} WHERE id = :id;\n"
        "-- name: settle_all\nUPDATE t SET {done};\n"
    )
    statements = load(text)
    assert statements["settle"].sql == "UPDATE t SET state = 'done', at = now() WHERE id = $1;"
    assert statements["settle_all"].sql == "UPDATE t SET state = 'done', at = now();"
    assert load_fragments(text) == {"done": "state = 'done', at = now()"}
    assert "done" not in load_dialects(text)["postgres"]  # a fragment is no statement


def test_a_fragment_names_fragments_before_it() -> None:
    text = (
        "-- fragment: done\nstate = 'done', at = :at\n\n"
        "-- fragment: settling\nUPDATE t SET {done} WHERE id = ANY(:ids::bigint[])\n\n"
        "-- name: settle\n{settling};\n"
    )
    assert load_fragments(text)["settling"] == (
        "UPDATE t SET state = 'done', at = :at WHERE id = ANY(:ids::bigint[])"
    )
    settle = load(text)["settle"]
    assert settle.sql == "UPDATE t SET state = 'done', at = $1 WHERE id = ANY($2::bigint[]);"
    assert settle.parameters == ("at", "ids")
    with pytest.raises(ValueError, match=r"fragment early names no fragment of the file: \{late\}"):
        load("-- fragment: early\n{late}\n-- fragment: late\na = 1\n")


def test_a_fragment_named_but_not_written_or_written_twice_or_per_server_does_not_load() -> None:
    with pytest.raises(ValueError, match=r"query settle names no fragment of the file: \{done\}"):
        load("-- name: settle\nUPDATE t SET {done};\n")
    with pytest.raises(ValueError, match="fragment done is written twice"):
        load("-- fragment: done\na = 1\n-- fragment: done\na = 2\n")
    with pytest.raises(ValueError, match="fragment done is shaped for citus in a file of one"):
        load("-- fragment: done [citus]\na = 1\n")


def test_a_fragment_shaped_per_server_gives_each_server_its_shape_in_a_shared_statement() -> None:
    text = (
        "-- fragment: rows [postgres]\nt.id = given.id\n"
        "-- fragment: rows [citus]\nt.key = ANY(:keys) AND t.id = given.id\n"
        "-- fragment: settling\nUPDATE t SET done FROM unnest(:keys) given WHERE {rows}\n"
        "-- name: settle\n{settling};\n"
    )
    dialects = load_dialects(text)
    assert dialects["postgres"]["settle"].sql == (
        "UPDATE t SET done FROM unnest($1) given WHERE t.id = given.id;"
    )
    assert dialects["citus"]["settle"].sql == (
        "UPDATE t SET done FROM unnest($1) given WHERE t.key = ANY($1) AND t.id = given.id;"
    )
    citus_rows = "t.key = ANY(:keys) AND t.id = given.id"
    assert load_fragments(text, "citus")["settling"].endswith(citus_rows)
    with pytest.raises(ValueError, match="fragment rows is written twice for citus"):
        load_dialects("-- fragment: rows [citus]\na\n-- fragment: rows [citus]\nb\n")
    with pytest.raises(ValueError, match="fragment rows is written twice for every server"):
        load_dialects("-- fragment: rows [citus]\na\n-- fragment: rows\nb\n")
    with pytest.raises(ValueError, match="fragment rows is written twice for citus"):
        load_dialects("-- fragment: rows\na\n-- fragment: rows [citus]\nb\n")
    with pytest.raises(ValueError, match="shaped for mysql, which is none of"):
        load_dialects("-- fragment: rows [mysql]\na\n")


def test_the_stored_answers_columns_are_one_fragment_for_the_complete_and_a_workers() -> None:
    # The complete a Citus worker runs on its own shard tables writes what queries.sql's does.
    completed = FRAGMENTS["citus"]["completed"]
    assert completed.startswith("state = 'completed',") and "claimed_by = NULL" in completed
    assert completed in DIALECTS["postgres"]["complete"].sql
    for build in (workers._complete, workers._claim_complete):
        assert build([102008, 102009]).count(completed) == 2  # once per shard table
