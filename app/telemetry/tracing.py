"""Distributed tracing: W3C trace context, and spans exported with OpenTelemetry's SDK over
OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the standard variable; the SDK reads the
other `OTEL_*` ones too, such as `OTEL_SERVICE_NAME`).

Design rules:
- Off unless asked. Without the variable nothing of the SDK is imported and the hooks below cost
  one `if`. The client's `traceparent` and `tracestate` still reach the upstream, as every
  end-to-end header does.
- On: one span per request on the proxy port (`oncegate request`, kind SERVER), a child of the
  client's trace context when it sent one; children for the store's `claim` and `settle`
  (complete, release, mark_unknown), and `forward` around the upstream call, whose
  `traceparent` then names the forward span, so the upstream's spans hang under the gateway's.
- Attributes hold the route, method, outcome and status, never keys, paths, bodies or
  credentials: the rule of the logs. The route and outcome are read from the request's log record
  (`oncegate.request`, which carries them as fields), so they need that logger at INFO.
- One tracer per process, kept here as OpenTelemetry keeps its provider: `setup` runs in each
  process that serves (after the fork of `--workers`, since the exporter's thread does not
  survive one).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, TypeVar, cast

from ..model import errors
from ..model.records import SETTLES

ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_ENDPOINT"
VARIABLES = (
    ENDPOINT_VARIABLE,
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_BSP_SCHEDULE_DELAY",
)
REQUEST_SPAN = "oncegate request"
_CLAIM = {"claim"}
# Only these fields of the request's log record become attributes (never the request id, which a
# client chooses, nor timings, which the span has).
_REQUEST_FIELDS = {
    "route": "oncegate.route",
    "outcome": "oncegate.outcome",
}

Name = TypeVar("Name", str, bytes)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# What `store_operation` gives when there is no span to open: one context that does nothing,
# made once rather than on every store operation.
_OFF = contextlib.nullcontext()

_tracer: Any = None  # an opentelemetry Tracer once `setup` found the variable
_provider: Any = None  # its TracerProvider, flushed by `shutdown`


def active() -> bool:
    return _tracer is not None


def variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The `OTEL_*` variables oncegate reads itself, checked: read once with the settings
    (`settings.load`), so a bad value stops the gateway before it starts, and `setup` reads
    nothing more. (The SDK, once `setup` starts it, reads its own other `OTEL_*` variables.)"""
    found = {name: environ[name] for name in VARIABLES if environ.get(name)}
    delay = found.get("OTEL_BSP_SCHEDULE_DELAY")
    if delay is not None and not delay.replace(".", "", 1).isdigit():
        raise errors.ConfigError(f"OTEL_BSP_SCHEDULE_DELAY is milliseconds, not {delay!r}")
    return found


def setup(environ: Mapping[str, str]) -> bool:
    """Start exporting spans if `OTEL_EXPORTER_OTLP_ENDPOINT` is set in `environ` (the
    settings' `otel_variables`, or a test's own); whether it did."""
    global _tracer, _provider
    if not environ.get(ENDPOINT_VARIABLE):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise errors.ConfigError(
            f"{ENDPOINT_VARIABLE} is set, but OpenTelemetry's SDK is not installed: "
            "pip install 'oncegate[tracing]', or unset the variable"
        ) from None
    service = environ.get("OTEL_SERVICE_NAME") or "oncegate"
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    # From the mapping given, not the SDK's own reading of os.environ, so that what `setup` was
    # told (what the settings read at load) is what it does. The generic endpoint gets the
    # signal's path (the OTLP spec's rule).
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or (
        environ[ENDPOINT_VARIABLE].rstrip("/") + "/v1/traces"
    )
    delay = variables(environ).get("OTEL_BSP_SCHEDULE_DELAY")
    processor = BatchSpanProcessor(
        OTLPSpanExporter(endpoint=endpoint),
        schedule_delay_millis=float(delay) if delay else None,
    )
    provider.add_span_processor(processor)
    _provider = provider
    _tracer = provider.get_tracer("oncegate")
    logging.getLogger("oncegate.request").addFilter(_annotate_from_log)
    return True


def shutdown() -> None:
    """Export what is left (the processor sends in batches) before the process ends."""
    global _tracer, _provider
    if _provider is None:
        return
    _provider.shutdown()
    logging.getLogger("oncegate.request").removeFilter(_annotate_from_log)
    _tracer = _provider = None


def wrap(app: ASGIApp) -> ASGIApp:
    """The proxy application inside a request span, when tracing is on."""
    if _tracer is None:
        return app
    tracer = _tracer

    async def traced(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in (b"traceparent", b"tracestate")
        }
        parent = TraceContextTextMapPropagator().extract(carrier)
        with tracer.start_as_current_span(
            REQUEST_SPAN, context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            span.set_attribute("http.request.method", scope["method"])

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(trace.Status(trace.StatusCode.ERROR))
                await send(message)

            await app(scope, receive, send_status)

    return traced


def store_operation(operation: str) -> contextlib.AbstractContextManager[object]:
    """A `claim` or `settle` child span around one store round trip (nothing when off, or for
    the operations that are neither)."""
    if _tracer is None:
        return _OFF
    if operation in _CLAIM:
        return _child("claim", operation)
    if operation in SETTLES:
        return _child("settle", operation)
    return _OFF


@contextlib.contextmanager
def forwarding(headers: Sequence[tuple[Name, Name]]) -> Iterator[list[tuple[Name, Name]]]:
    """The `forward` span around an upstream call, and the headers to send (names and values as
    `str` or as `bytes`, as given): the client's trace context replaced by one naming this span.
    Off: the headers as they are."""
    if _tracer is None:
        yield list(headers)
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    with _tracer.start_as_current_span("forward"):
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        as_bytes = bool(headers) and isinstance(headers[0][0], bytes)
        replaced = {name.encode() if as_bytes else name for name in carrier} | {
            "traceparent",
            "tracestate",
            b"traceparent",
            b"tracestate",
        }
        kept = [(name, value) for name, value in headers if name.lower() not in replaced]
        pairs = sorted(carrier.items())
        added = [(name.encode(), value.encode()) for name, value in pairs] if as_bytes else pairs
        yield kept + cast(list[tuple[Name, Name]], added)


@contextlib.contextmanager
def _child(name: str, operation: str) -> Iterator[object]:
    with _tracer.start_as_current_span(name) as span:
        span.set_attribute("oncegate.store.operation", operation)
        yield span


def annotate(route: str, outcome: str) -> None:
    """Name the current request span's route and outcome (the proxy's accounting can call this
    directly; until it does, `_annotate_from_log` calls it from the request's log line)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(_REQUEST_FIELDS["route"], route)
        span.set_attribute(_REQUEST_FIELDS["outcome"], outcome)


def _annotate_from_log(record: logging.LogRecord) -> bool:
    """Copy the route and outcome of the request's log line onto its span. Logs it unchanged."""
    fields = getattr(record, "fields", None)
    if isinstance(fields, dict):
        route, outcome = fields.get("route"), fields.get("outcome")
        if isinstance(route, str) and isinstance(outcome, str):
            annotate(route, outcome)
    return True
