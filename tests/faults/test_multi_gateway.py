"""Three gateway processes on one PostgreSQL: each key reaches the upstream exactly once.

`KEYS` keys, each sent `COPIES` times at once, the copies spread round-robin over the three
gateways (copy i of key k goes to gateway (k + i) % 3), at most `CONCURRENCY` requests in flight.
The demo upstream holds each answer back `DELAY` seconds so that copies really overlap. A copy
answered 409 `request-in-progress` is retried (after a short pause, on the next gateway) until it
gets the stored answer, so every client ends with the same receipt as the one that was forwarded.

Counted from what the demo upstream really performed: each key exactly once (no duplicates, none
lost), and every client of a key holds the same receipt id. The counts are printed.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.faults.conftest import DemoUpstream, GatewayProcess

# On the embedded PostgreSQL and on a Citus cluster (`backend`, tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.citus]

GATEWAYS, KEYS, COPIES, CONCURRENCY = 3, 300, 5, 60
DELAY = "0.05"
DEADLINE = 60.0  # seconds for the whole run; about 10-15 s on 2 cores


@pytest.fixture(scope="module")
def gateways(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[list[GatewayProcess]]:
    route = {"name": "mail", "match": "/", "upstream": upstream.url}
    started: list[GatewayProcess] = []
    try:
        for number in range(GATEWAYS):
            started.append(
                GatewayProcess(module_dir, database_url, [route], name=f"gateway-{number}")
            )
        yield started
    finally:
        for gateway in started:
            gateway.stop()


async def test_many_keys_with_concurrent_duplicates_over_three_gateways(
    gateways: list[GatewayProcess], upstream: DemoUpstream
) -> None:
    keys = [str(uuid.uuid4()) for _ in range(KEYS)]
    outcomes: collections.Counter[str] = collections.Counter()
    receipts: dict[str, set[str]] = collections.defaultdict(set)
    limit = asyncio.Semaphore(CONCURRENCY)
    clients = [
        httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=httpx.Limits(max_connections=40))
        for gateway in gateways
    ]

    async def send(number: int, key: str, copy: int) -> None:
        body = {"key_number": number}
        headers = {"Idempotency-Key": key, "X-Demo-Delay": DELAY}
        for attempt in range(100):
            client = clients[(number + copy + attempt) % GATEWAYS]
            async with limit:
                response = await client.post("/charges", json=body, headers=headers)
            if response.status_code == 409:
                outcomes["in_progress"] += 1
                await asyncio.sleep(0.05)
                continue
            assert response.status_code == 201, response.text
            replayed = response.headers.get("idempotent-replayed") == "true"
            outcomes["replayed" if replayed else "forwarded"] += 1
            receipts[key].add(response.json()["id"])
            return
        raise AssertionError(f"key {key} never settled")

    started = time.monotonic()
    try:
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    send(number, key, copy)
                    for number, key in enumerate(keys)
                    for copy in range(COPIES)
                )
            ),
            DEADLINE,
        )
    finally:
        for client in clients:
            await client.aclose()
    elapsed = time.monotonic() - started

    performed = collections.Counter(action["idempotency_key"] for action in upstream.actions())
    duplicates = sum(performed[key] - 1 for key in keys if performed[key] > 1)
    lost = sum(1 for key in keys if performed[key] == 0)
    print(  # noqa: T201 - the figures the fault suite reports (pytest -s)
        f"\n{GATEWAYS} gateways, {KEYS} keys x {COPIES} concurrent copies in {elapsed:.1f}s: "
        f"{sum(outcomes.values())} requests sent ({dict(outcomes)}); the upstream performed "
        f"{sum(performed[key] for key in keys)} actions for {KEYS} keys; duplicates {duplicates}, "
        f"lost {lost}"
    )
    assert duplicates == 0 and lost == 0
    assert all(performed[key] == 1 for key in keys)
    assert outcomes["forwarded"] == KEYS
    assert outcomes["forwarded"] + outcomes["replayed"] == KEYS * COPIES
    assert all(len(receipts[key]) == 1 for key in keys)  # every client got the same receipt
    assert outcomes["in_progress"] > 0  # the copies really overlapped
