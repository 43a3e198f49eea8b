"""`oncegate demo-upstream` from outside: what a gateway in front of it can rely on."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.e2e.conftest import DemoUpstream


def test_action_ids_are_unique_across_restarts(tmp_path: Path) -> None:
    # A gateway keeps answers across the demo's restarts: a new action must never get an id
    # (and a Location) that a stored answer already names.
    ids = []
    for _ in range(2):
        demo = DemoUpstream(tmp_path)
        try:
            for kind in ("emails", "emails", "charges"):
                receipt = httpx.post(f"{demo.url}/{kind}", json={"n": 1}, timeout=10)
                assert receipt.status_code == 201
                assert receipt.headers["location"] == f"/actions/{receipt.json()['id']}"
                ids.append(receipt.json()["id"])
        finally:
            demo.process.stop()
    assert len(set(ids)) == len(ids), ids
    assert ids[0].startswith("em_") and ids[2].startswith("ch_")
