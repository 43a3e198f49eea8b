"""The cyclic collector as the gateway serves (`http.server.quiet_collector`): what exists at the
start is frozen, and young collections are rare (docs/performance.md measures both)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from oncegate.http import server


@pytest.fixture
def collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def test_serving_freezes_what_exists_and_collects_young_objects_less_often(
    collector: None,
) -> None:
    _, middle, old = gc.get_threshold()
    tracked = [object()]  # a list: the collector tracks it

    server.quiet_collector()

    assert gc.get_threshold() == (server.YOUNG_COLLECTIONS_EVERY, middle, old)
    assert server.YOUNG_COLLECTIONS_EVERY > 700  # CPython's default, measured dearer
    assert gc.get_freeze_count() > 0
    assert gc.is_tracked(tracked)
    assert not any(referrer is tracked for referrer in gc.get_objects())  # frozen: out of sight
