"""The in-memory store's `capacity` (bench/memory_gateway.py's store lives through a whole
benchmark): beyond it a claim drops the oldest key, and only a settled one, never a claim in
flight."""

from __future__ import annotations

from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim
from oncegate.store.memory import MemoryStore

SCOPE = b"scope"


async def claim(store: MemoryStore, key: str) -> Claim:
    claimed = await store.claim("route", SCOPE, key, b"fingerprint", 60.0, 3600.0)
    assert isinstance(claimed, Claim)
    return claimed


async def test_a_claim_beyond_the_capacity_drops_the_oldest_settled_key() -> None:
    store = MemoryStore(capacity=2)
    first = await claim(store, "first")
    assert await store.complete(first, StoredAnswer(201, None))
    second = await claim(store, "second")
    assert await store.complete(second, StoredAnswer(201, None))

    await claim(store, "third")

    assert await store.get(SCOPE, "first") is None
    assert await store.get(SCOPE, "second") is not None
    assert await store.get(SCOPE, "third") is not None


async def test_a_claim_in_flight_is_never_dropped() -> None:
    store = MemoryStore(capacity=1)
    first = await claim(store, "first")

    await claim(store, "second")

    assert await store.get(SCOPE, "first") is not None
    assert await store.complete(first, StoredAnswer(201, None))  # its holder still settles it
