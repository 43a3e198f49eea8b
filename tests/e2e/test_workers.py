"""`--workers N`: several processes serve one gateway's sockets; the database keeps them honest,
the parent replaces a worker that dies, and /metrics adds up every worker's counters."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from oncegate.settings import units
from tests.e2e.conftest import DemoUpstream, GatewayProcess
from tests.helpers import total


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    route = {"name": "mail", "match": "/", "upstream": upstream.url}
    with GatewayProcess(module_dir, database_url, [route], args=["--workers", "2"]) as process:
        yield process


def workers(gateway: GatewayProcess) -> list[psutil.Process]:
    return psutil.Process(gateway.process.pid).children()


def wait_for_workers(
    gateway: GatewayProcess, count: int, gone: int | None = None
) -> list[psutil.Process]:
    """Wait until `count` live workers serve, none of them the process `gone`."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = []
        for child in workers(gateway):
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.status() != psutil.STATUS_ZOMBIE and child.pid != gone:
                    found.append(child)
        if len(found) == count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"expected {count} workers, found {workers(gateway)}")


async def test_several_workers_forward_each_key_once_and_count_together(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    assert len(wait_for_workers(gateway, 2)) == 2
    shared = str(uuid.uuid4())
    own = [str(uuid.uuid4()) for _ in range(20)]
    limits = httpx.Limits(max_connections=60)
    async with httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=30) as client:
        answers = await asyncio.gather(
            *(client.post("/charges", json={"amount": 1},
                          headers={"Idempotency-Key": shared, "X-Demo-Delay": "0.5"})
              for _ in range(40)),
            *(client.post("/emails", json={}, headers={"Idempotency-Key": key}) for key in own),
        )  # fmt: skip
    assert all(answer.status_code in (201, 409) for answer in answers)
    assert len(upstream.actions(shared)) == 1
    assert all(len(upstream.actions(key)) == 1 for key in own)
    async with httpx.AsyncClient(base_url=gateway.admin_url) as admin:
        assert total((await admin.get("/metrics")).text, "oncegate_requests_total") == 60


async def test_a_worker_that_dies_is_replaced(
    gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    victim = wait_for_workers(gateway, 2)[0]
    victim.send_signal(signal.SIGKILL)
    replaced = wait_for_workers(gateway, 2, gone=victim.pid)
    assert victim.pid not in {worker.pid for worker in replaced}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        for _ in range(10):
            key = str(uuid.uuid4())
            response = await client.post("/emails", json={}, headers={"Idempotency-Key": key})
            assert response.status_code == 201


def test_sigterm_stops_every_worker(gateway: GatewayProcess) -> None:
    children = wait_for_workers(gateway, 2)
    gateway.process.signal(signal.SIGTERM)
    assert gateway.process.wait() == 0
    assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE
                   for child in children)  # fmt: skip


async def test_workers_auto_serves_with_one_worker_per_usable_core(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> None:
    route = {"name": "mail", "match": "/", "upstream": upstream.url}
    cores = units.usable_cores()  # this machine's, as the gateway reads them
    with GatewayProcess(
        module_dir, database_url, [route], name="auto", args=["--workers", "auto"]
    ) as auto:
        # One core: the gateway serves in its own process, as with --workers 1 (no fork).
        forked = cores if cores > 1 else 0
        assert len(wait_for_workers(auto, forked)) == forked
        async with httpx.AsyncClient(base_url=auto.url, timeout=30) as client:
            key = str(uuid.uuid4())
            response = await client.post("/emails", json={}, headers={"Idempotency-Key": key})
        assert response.status_code == 201
        assert len(upstream.actions(key)) == 1
