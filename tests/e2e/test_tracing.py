"""Tracing: a real gateway exports its spans over OTLP/HTTP to a real receiver started here, which
decodes them as any collector would (the OTLP protobuf messages)."""

from __future__ import annotations

import gzip
import http.server
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.e2e.conftest import DemoUpstream, GatewayProcess
from tests.helpers import free_port

DEADLINE = 30.0  # for the batch to arrive; never a measured time


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver on loopback: every span it was sent, decoded."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.spans: list[Any] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def wait_for(self, names: set[str]) -> list[Any]:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            with self.lock:
                if names <= {span.name for span in self.spans}:
                    return list(self.spans)
            time.sleep(0.05)
        raise AssertionError(f"spans {names} never arrived; got {[s.name for s in self.spans]}")


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        assert self.path == "/v1/traces"
        request = ExportTraceServiceRequest.FromString(body)
        with self.server.lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.server.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def attributes(span: Any) -> dict[str, Any]:
    found = {}
    for item in span.attributes:
        value = item.value
        found[item.key] = value.int_value if value.HasField("int_value") else value.string_value
    return found


def test_a_request_is_one_span_under_the_clients_trace_with_claim_and_settle_children(
    receiver: Receiver, database_url: str, upstream: DemoUpstream, tmp_path: Path
) -> None:
    route = {"name": "mail", "match": "/", "upstream": upstream.url}
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    key = f"secret-key-{uuid.uuid4()}"
    credential = "Bearer credential-that-must-not-leak"
    with GatewayProcess(
        tmp_path,
        database_url,
        [route],
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"},
    ) as gateway:
        answer = httpx.post(
            gateway.url + "/emails?to=secret-path-value",
            json={"body": "secret body"},
            headers={
                "Idempotency-Key": key,
                "Authorization": credential,
                "traceparent": f"00-{trace_id}-{client_span}-01",
                "tracestate": "vendor=value",
            },
        )
        assert answer.status_code == 201
        spans = receiver.wait_for({"oncegate request", "claim", "settle"})
    request = next(span for span in spans if span.name == "oncegate request")
    assert request.trace_id.hex() == trace_id
    assert request.parent_span_id.hex() == client_span  # a child of the client's span
    assert attributes(request) == {
        "http.request.method": "POST",
        "http.response.status_code": 201,
        "oncegate.route": "mail",
        "oncegate.outcome": "forwarded",
    }
    children = {span.name: span for span in spans if span.parent_span_id == request.span_id}
    assert {"claim", "settle"} <= set(children)
    assert attributes(children["claim"]) == {"oncegate.store.operation": "claim"}
    assert attributes(children["settle"]) == {"oncegate.store.operation": "complete"}
    # Never a key, a path, a body or a credential in what was exported.
    exported = b"".join(span.SerializeToString() for span in spans)
    for secret in (key, "secret-path-value", "secret body", "credential-that-must-not-leak"):
        assert secret.encode() not in exported


async def test_the_forward_hook_sends_the_upstream_a_traceparent_naming_the_forward_span(
    receiver: Receiver,
) -> None:
    """`tracing.forwarding`, the hook around the upstream call: the upstream's spans then hang
    under the gateway's `forward` span, in the client's trace."""
    from oncegate.telemetry import tracing

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    received: list[list[tuple[str, str]]] = []

    async def proxy(scope: Any, receive: Any, send: Any) -> None:
        headers = [("traceparent", f"00-{trace_id}-{client_span}-01"), ("x-other", "kept")]
        with tracing.forwarding(headers) as sent:
            received.append(sent)

    async def ignore(message: Any) -> None:
        pass

    assert tracing.setup(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    )
    try:
        scope = {
            "type": "http",
            "method": "POST",
            "headers": [(b"traceparent", f"00-{trace_id}-{client_span}-01".encode())],
        }
        await tracing.wrap(proxy)(scope, ignore, ignore)  # fmt: skip
    finally:
        tracing.shutdown()
    assert not tracing.active()
    spans = receiver.wait_for({"oncegate request", "forward"})
    forward = next(span for span in spans if span.name == "forward")
    request = next(span for span in spans if span.name == "oncegate request")
    assert forward.parent_span_id == request.span_id
    sent = dict(received[0])
    assert sent["x-other"] == "kept"
    assert sent["traceparent"] == f"00-{trace_id}-{forward.span_id.hex()}-01"
    assert [name for name, _ in received[0]].count("traceparent") == 1


def test_the_forward_hook_keeps_bytes_headers_as_bytes_and_changes_nothing_when_off() -> None:
    from oncegate.telemetry import tracing

    assert not tracing.active()
    headers = [(b"traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01"), (b"x", b"\xe9")]
    with tracing.forwarding(headers) as sent:
        assert sent == headers  # off: byte for byte
