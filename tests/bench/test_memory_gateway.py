"""`bench/memory_gateway.py`, the bench's in-memory row, is the gateway's request path with only
the store swapped: `make bench` reads the gateway's own Python as its CPU less the bare proxy's,
which holds only if it does what the gateway does (claim, forward once, store, replay, refuse a
changed retry) on the gateway's event loop, not a shortcut.

A test of the bench's instrument, not of the gateway: what the gateway does is shown on
PostgreSQL (tests/e2e), never on the in-memory store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import DemoUpstream, Process, keyed, problem_name
from tests.helpers import free_port, new_key

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "memory_gateway.py"


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("memory-gateway")


@pytest.fixture(scope="module")
def upstream(module_dir: Path) -> Iterator[DemoUpstream]:
    with DemoUpstream(module_dir) as demo:
        yield demo


@pytest.fixture(scope="module")
def memory_gateway(module_dir: Path, upstream: DemoUpstream) -> Iterator[tuple[str, int]]:
    port = free_port()
    config = module_dir / "memory-gateway.yaml"
    config.write_text(yaml.safe_dump({"routes": [{"name": "emails", "match": "/emails",
                                                  "upstream": upstream.url}]}))  # fmt: skip
    process = Process(
        ["--upstream", upstream.url, "--config", str(config), "--port", str(port)],
        module_dir / "memory-gateway.log",
        program=[str(SCRIPT)],
    )
    try:
        process.wait_listening(port)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.stop()


def test_it_forwards_once_replays_the_retry_and_refuses_a_changed_one(
    memory_gateway: tuple[str, int], upstream: DemoUpstream
) -> None:
    key = new_key()
    with httpx.Client(base_url=memory_gateway[0]) as client:
        first = client.post("/emails", json={"to": "a@example.com"}, headers=keyed(key))
        retry = client.post("/emails", json={"to": "a@example.com"}, headers=keyed(key))
        changed = client.post("/emails", json={"to": "b@example.com"}, headers=keyed(key))
        keyless = client.post("/emails", json={"to": "a@example.com"})

    assert first.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert (retry.status_code, retry.content) == (201, first.content)
    assert retry.headers["idempotent-replayed"] == "true"
    assert changed.status_code == 422
    assert problem_name(changed) == "key-reused"
    assert keyless.status_code == 400
    assert len(upstream.actions(key)) == 1


def test_it_serves_on_the_gateways_event_loop(memory_gateway: tuple[str, int]) -> None:
    # uvicorn loads uvloop only for the loop it makes: mapped into the process, it is the loop.
    # (The first version of the instrument ran on asyncio's own loop, and measured that.)
    maps = Path(f"/proc/{memory_gateway[1]}/maps").read_text()
    assert "uvloop" in maps
