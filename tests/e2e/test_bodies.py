"""Request bodies through a real gateway in front of the real demo upstream, on a real
PostgreSQL: what makes a retry's body "the same request" (contract section 11, "request
bodies"), and keys read from large bodies without stalling anyone ("key from a large body").
Each test says what the client saw, what the upstream performed and what the store holds."""

from __future__ import annotations

import asyncio
import gzip
import json
import statistics
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import (
    DemoUpstream,
    GatewayProcess,
    keyed,
    prefix_route,
    problem_name,
    row,
)
from tests.helpers import new_key

MULTIPART = "multipart/form-data"


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    routes: list[dict[str, Any]] = [
        prefix_route("files", upstream.url),
        prefix_route("bulk", upstream.url),
        prefix_route("bulkbody", upstream.url, key_from_body="/idempotency_key"),
    ]
    with GatewayProcess(module_dir, database_url, routes) as process:
        yield process


def upload(
    purpose: str = "dispute_evidence", content: bytes = b"%PDF-1.4 receipt"
) -> dict[str, Any]:
    """The parts of a document upload, as httpx's `files=` and `data=` encode them: with a new
    random boundary every time a request is built."""
    return {
        "data": {"purpose": purpose},
        "files": {"file": ("receipt.pdf", content, "application/pdf")},
    }


async def send(client: httpx.AsyncClient, key: str, **parts: Any) -> tuple[httpx.Response, str]:
    """The answer to a multipart POST, and the boundary its body was encoded with."""
    request = client.build_request("POST", "/files/tickets", headers=keyed(key), **parts)
    media, _, boundary = request.headers["content-type"].partition("; boundary=")
    assert media == MULTIPART and boundary
    return await client.send(request), boundary


async def test_a_retry_of_an_upload_with_a_new_boundary_is_replayed(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()
    first, boundary = await send(client, key, **upload())
    assert first.status_code == 201
    retry, other_boundary = await send(client, key, **upload())
    assert other_boundary != boundary  # the encoder drew a new one, as SDKs do on a retry
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert len(upstream.actions(key)) == 1
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"


@pytest.mark.parametrize(
    "changed",
    [upload(purpose="identity_document"), upload(content=b"%PDF-1.4 another receipt")],
    ids=["a-field", "the-file"],
)
async def test_an_upload_of_other_parts_under_the_key_is_refused(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection,
    changed: dict[str, Any],
) -> None:  # fmt: skip
    key = new_key()
    first, _ = await send(client, key, **upload())
    assert first.status_code == 201
    reused, _ = await send(client, key, **changed)
    assert reused.status_code == 422 and problem_name(reused) == "key-reused"
    assert len(upstream.actions(key)) == 1
    stored = await row(db, key)  # the key still holds the first upload's answer
    assert stored is not None and stored["state"] == "completed"
    again, _ = await send(client, key, **upload())
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"


def malformed(boundary: str) -> bytes:
    """Parts whose last delimiter is missing: not well-formed multipart."""
    return (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'
        "dispute_evidence\r\n"
    ).encode()


async def test_a_malformed_multipart_body_is_forwarded_and_compared_as_its_bytes(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()

    async def post(boundary: str) -> httpx.Response:
        return await client.post(
            "/files/tickets",
            content=malformed(boundary),
            headers=keyed(key, **{"Content-Type": f"{MULTIPART}; boundary={boundary}"}),
        )

    first = await post("one")
    assert first.status_code == 201  # the gateway does not judge the body; the upstream may
    assert len(upstream.actions(key)) == 1
    same_bytes = await post("one")
    assert same_bytes.status_code == 201 and same_bytes.headers["idempotent-replayed"] == "true"
    redrawn = await post("two")
    assert redrawn.status_code == 422 and problem_name(redrawn) == "key-reused"
    assert len(upstream.actions(key)) == 1
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"


async def test_json_numbers_compare_by_their_exact_decimal_value(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    key = new_key()

    async def post(amount: bytes) -> httpx.Response:
        return await client.post(
            "/files/charges",
            content=b'{"amount": ' + amount + b', "currency": "eur"}',
            headers=keyed(key, **{"Content-Type": "application/json"}),
        )

    first = await post(b"0.123456789012345678")
    assert first.status_code == 201
    # A float holds both as 0.12345678901234568; they are two amounts all the same.
    other = await post(b"0.123456789012345677")
    assert other.status_code == 422 and problem_name(other) == "key-reused"
    respelled = await post(b"1234567890123456780e-19")  # the first amount, written otherwise
    assert respelled.status_code == 201 and respelled.headers["idempotent-replayed"] == "true"
    assert len(upstream.actions(key)) == 1
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"


async def test_a_gzipped_body_compressed_again_for_its_retry_is_replayed(
    client: httpx.AsyncClient, upstream: DemoUpstream, db: asyncpg.Connection
) -> None:
    """A client that compresses its bodies compresses its retry again, and gzip writes the time
    into every header it makes: the same document, other bytes. And the same bytes sent
    without their coding are another document to the upstream."""
    key = new_key()
    document = b'{"amount": 100, "currency": "eur"}'

    async def post(body: bytes, **coding: str) -> httpx.Response:
        headers = keyed(key, **{"Content-Type": "application/json", **coding})
        return await client.post("/files/charges", content=body, headers=headers)

    first = await post(gzip.compress(document, mtime=1_700_000_000), **{"Content-Encoding": "gzip"})
    assert first.status_code == 201
    later = gzip.compress(document, mtime=1_700_000_007)
    retry = await post(later, **{"Content-Encoding": "gzip"})
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    undeclared = await post(later)
    assert undeclared.status_code == 422 and problem_name(undeclared) == "key-reused"
    other = await post(gzip.compress(b'{"amount": 900, "currency": "eur"}', mtime=1_700_000_007),
                       **{"Content-Encoding": "gzip"})  # fmt: skip
    assert other.status_code == 422 and problem_name(other) == "key-reused"
    assert len(upstream.actions(key)) == 1
    stored = await row(db, key)
    assert stored is not None and stored["state"] == "completed"


# -- a key read from a large body stalls nobody ------------------------------------------------

LARGE_BODIES = 3


def large_body(key: str) -> bytes:
    """About 8.6 MiB of JSON, many small objects (the costly kind to parse), the key last."""
    items = [{"id": index, "name": f"line item {index}", "amount": 1234, "tags": ["a", "b"]}
             for index in range(116_000)]  # fmt: skip
    return json.dumps({"items": items, "idempotency_key": key}).encode()


async def probe_latencies(
    probes: httpx.AsyncClient, uploads: list[Awaitable[httpx.Response]]
) -> tuple[list[float], list[httpx.Response]]:
    """How long each of a stream of small requests (one at a time, passed through to the
    upstream) took while `uploads` were in flight; and the uploads' answers."""
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    uploading = asyncio.gather(*uploads)
    while not uploading.done():
        started = loop.time()
        answer = await probes.get("/files/echo/probe")
        latencies.append(loop.time() - started)
        assert answer.status_code == 200
    return latencies, await uploading


# Not marked slow (about 15 s): it is the contract's test of "key from a large body", which
# `make test` covers whole.
async def test_keys_read_from_large_bodies_stall_others_no_more_than_header_keys(
    gateway: GatewayProcess, db: asyncpg.Connection
) -> None:
    """While three 8.6 MiB JSON bodies are read for their key, other requests wait about as
    long as beside three such bodies on a header-key route. Both are measured in one run,
    alternating, so a busy machine slows both alike. Parsed in a thread (as before), the body
    route held probes 0.5-2 s, ten times and more the header route's; the bound is 4 times
    (with a floor of 25 ms under the header route's figure, as that can be a few ms)."""
    template = large_body("KEY").split(b'"KEY"')
    limits = httpx.Limits(max_connections=LARGE_BODIES)
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as uploads,
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as probes,
    ):
        await probes.get("/files/echo/probe")  # the probe's connection, open before timing

        async def round_of(route: str) -> tuple[float, list[str]]:
            keys = [new_key() for _ in range(LARGE_BODIES)]
            bodies = [template[0] + json.dumps(key).encode() + template[1] for key in keys]
            headers = {"Content-Type": "application/json"}
            if route == "bulkbody":
                posts = [uploads.post("/bulkbody/sink", content=body, headers=headers)
                         for body in bodies]  # fmt: skip
            else:
                posts = [uploads.post("/bulk/sink", content=body,
                                      headers=keyed(key, **headers))
                         for key, body in zip(keys, bodies, strict=True)]  # fmt: skip
            latencies, answers = await probe_latencies(probes, posts)
            assert [answer.status_code for answer in answers] == [201] * LARGE_BODIES, [
                answer.text[:400] for answer in answers
            ]
            return statistics.quantiles(latencies, n=10)[-1], keys

        figures: dict[str, list[float]] = {"bulk": [], "bulkbody": []}
        for route in ("bulk", "bulkbody", "bulk", "bulkbody"):
            p90, keys = await round_of(route)
            figures[route].append(p90)
            for key in keys:  # each large request was stored under the key it carried
                stored = await row(db, key)
                assert stored is not None and stored["state"] == "completed"
    header_route, body_route = (statistics.mean(figures[name]) for name in ("bulk", "bulkbody"))
    assert body_route <= 4 * max(header_route, 0.025), figures
