"""What the request path writes on every request, written more cheaply and still the same bytes:
JSON from encoders made once (`model.jsontext`), the request log line written straight to the
JSON handler from its known shape (`telemetry.logs.request_line`), request ids from batched
randomness (`kernel.headers.new_request_id`); and what it reads on every replay, read more
cheaply with the same outcome: the stored headers (`kernel.sealing.header_pairs`)."""

from __future__ import annotations

import io
import json
import logging
import os
import uuid
from collections.abc import Iterator

import pytest

from oncegate.kernel import headers, sealing
from oncegate.model import jsontext
from oncegate.model.outcomes import Outcome
from oncegate.telemetry import logs

VALUES: list[object] = [
    [],
    {},
    "plain",
    'quote " backslash \\ control \x01 and é and \U0001f600',
    [1, 2.5, -0.0, 1e300, None, True, False],
    {"b": [1, {"z": "é", "a": None}], "a": 2, "": ""},
    ["POST", "/emails", "a=1", [("content-type", "application/json"), ("x-k", "v")]],
    [("set-cookie", "a=b"), ("x-é", "\u2603")],
]
OPTIONS: list[dict[str, object]] = [
    {},
    {"separators": (",", ":")},
    {"sort_keys": True, "separators": (",", ":"), "ensure_ascii": False, "allow_nan": False},
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("value", VALUES)
def test_a_writer_writes_what_an_encoder_with_the_same_options_writes(
    value: object, options: dict[str, object]
) -> None:
    assert jsontext.writer(**options)(value) == json.JSONEncoder(**options).encode(value)  # type: ignore[arg-type]


def test_a_writer_refuses_what_the_encoder_refuses() -> None:
    with pytest.raises(TypeError):
        jsontext.writer()([object()])
    with pytest.raises(ValueError):
        jsontext.writer(allow_nan=False)([float("nan")])
    assert jsontext.writer(default=str)([Outcome.FORWARDED, uuid.UUID(int=1)]) == json.dumps(
        [Outcome.FORWARDED, uuid.UUID(int=1)], default=str
    )


@pytest.fixture
def json_logs() -> Iterator[io.StringIO]:
    """The gateway's JSON logging, its handler writing to a buffer; logging as it was after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    logs.configure("json", "info")
    stream = io.StringIO()
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    try:
        yield stream
    finally:
        root.handlers[:], root.level = saved
        logs._json_handler = None


REQUEST_ID = 'a"quote\\d'
FIELDS = {
    "route": "default",
    "method": "POST",
    "outcome": Outcome.FORWARDED,
    "status": 201,
    "upstream_ms": 0.532,
    "total_ms": 12.25,
    "request_id": REQUEST_ID,
}
ARGUMENTS = ("default", "POST", Outcome.FORWARDED, 201, REQUEST_ID)


def lines_of(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


LINES: list[dict[str, object]] = [
    FIELDS,
    # An error of the gateway's own (no upstream time), a route no route matched, a time that
    # the encoder writes in exponent form, a non-ASCII and a control character.
    {**FIELDS, "outcome": Outcome.UNKNOWN, "status": 503, "upstream_ms": None},
    {**FIELDS, "route": "(unmatched)", "total_ms": 1e-05},
    {**FIELDS, "route": "r\u00e9", "method": "PATCH", "request_id": "id\x01\u2603"},
    {**FIELDS, "total_ms": 0.0, "upstream_ms": 123456.789},
]


@pytest.mark.parametrize("fields", LINES)
def test_the_request_line_written_straight_is_the_line_logging_writes(
    json_logs: io.StringIO, monkeypatch: pytest.MonkeyPatch, fields: dict[str, object]
) -> None:
    log = logging.getLogger("oncegate.request")
    monkeypatch.setattr(logs.time, "time", lambda: 1764892800.1234)
    monkeypatch.setattr(logging.time, "time", lambda: 1764892800.1234)  # the record's clock
    logs.request_line(log, *fields.values())  # type: ignore[arg-type]
    arguments = [fields[name] for name in ("route", "method", "outcome", "status", "request_id")]
    log.info("%s %s %s -> %d %s", *arguments, extra={"fields": fields})
    straight, through_logging = json_logs.getvalue().splitlines()
    assert straight == through_logging
    assert json.loads(straight)["message"] == "{} {} {} -> {} {}".format(*arguments)


def test_a_record_goes_through_logging_when_something_else_would_see_it(
    json_logs: io.StringIO,
) -> None:
    """A filter on the way, another handler (a test's capture), a level: each sees the record
    as before, and the line is still written once."""
    log = logging.getLogger("oncegate.request")
    seen: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    def mark(record: logging.LogRecord) -> bool:
        seen.append(record)
        return True

    log.addFilter(mark)
    try:
        logs.request_line(log, *FIELDS.values())  # type: ignore[arg-type]
    finally:
        log.removeFilter(mark)
    capture = Capture()
    logging.getLogger().addHandler(capture)
    try:
        logs.request_line(log, *FIELDS.values())  # type: ignore[arg-type]
    finally:
        logging.getLogger().removeHandler(capture)
    assert [record.fields for record in seen] == [FIELDS, FIELDS]  # type: ignore[attr-defined]
    assert len(lines_of(json_logs)) == 2
    log.setLevel(logging.WARNING)
    try:
        logs.request_line(log, *FIELDS.values())  # type: ignore[arg-type]
    finally:
        log.setLevel(logging.NOTSET)
    assert len(lines_of(json_logs)) == 2  # below the level: not written


def test_a_text_log_gets_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    logs.configure("text", "info")
    stream = io.StringIO()
    root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
    try:
        logs.request_line(logging.getLogger("oncegate.request"), *FIELDS.values())  # type: ignore[arg-type]
    finally:
        root.handlers[:], root.level = saved
    assert stream.getvalue().endswith(
        f" INFO oncegate.request: default POST forwarded -> 201 {REQUEST_ID}\n"
    )


def test_request_ids_are_version_4_uuids_none_twice() -> None:
    made = [headers.new_request_id() for _ in range(3 * 256 + 5)]  # past a few batches
    assert len(set(made)) == len(made)
    for text in made:
        assert len(text) == 32
        assert uuid.UUID(text).version == 4
        assert uuid.UUID(text).variant == uuid.RFC_4122


def test_a_forked_worker_does_not_hand_out_its_parents_next_ids() -> None:
    headers.new_request_id()  # the parent holds a batch
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first ids, then out without the test session's cleanup
        os.write(write, "".join(headers.new_request_id() for _ in range(4)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        child = pipe.read()
    parent = "".join(headers.new_request_id() for _ in range(4))
    assert len(child) == len(parent) == 128
    assert not {child[i : i + 32] for i in range(0, 128, 32)} & {
        parent[i : i + 32] for i in range(0, 128, 32)
    }


STORED_HEADERS: list[bytes] = [
    b'[["content-type", "application/json"], ["etag", "\\"e\\""]]',  # as PostgreSQL prints jsonb
    b'[["a","b"],["c","\\ud800"]]',  # as the gateway writes them, a lone surrogate kept
    b"[]",
    b' [["a", "b"]] ',
    b'\n[["x", "y"]]\n\t',
    b'[["\\u00e9", "\xc3\xa9"]]',
    b"",
    b"   ",
    b'[["a", "b"]] x',
    b'[["a", "b"]][]',
    b'[["a", "b"]',
    b'[["a", "b"]]]',
    b'{"a": "b"}',
    b'{"ab": 1}',
    b'[["a", 1]]',
    b'[["a"]]',
    b'[["a", "b", "c"]]',
    b'"ab"',
    b"null",
    b"1",
    b"[NaN]",
    b"\xff",
]


def _pairs_as_json_reads_them(data: bytes) -> list[tuple[str, str]] | None:
    """The stored headers as `json.loads` reads them, None where the gateway refuses them."""
    try:
        pairs = [(name, value) for name, value in json.loads(data)]
    except (ValueError, TypeError):
        return None
    if not all(isinstance(name, str) and isinstance(value, str) for name, value in pairs):
        return None
    return pairs


@pytest.mark.parametrize("data", STORED_HEADERS)
def test_stored_headers_are_read_as_json_reads_them(data: bytes) -> None:
    expected = _pairs_as_json_reads_them(data)
    if expected is None:
        with pytest.raises(sealing.Unopenable):
            sealing.header_pairs(data)
    else:
        assert sealing.header_pairs(data) == expected
