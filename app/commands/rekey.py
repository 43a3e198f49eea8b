"""`oncegate rekey`: re-seal every stored answer (and every request kept behind a key) under
the newest key, so an old one can go.

Batches are bounded: each is one transaction that locks its rows, waiting for a row another
writer holds rather than skipping it (a skipped row would keep the old key), so a rekey can run
beside live gateways and be stopped and started again at any point: it picks up what is left.
On a terminal it draws a progress bar; otherwise it prints one line per batch.
"""

from __future__ import annotations

import asyncio
from typing import TextIO

from ..kernel.sealing import Keyring
from ..settings import StoreOptions
from ..store.postgres import PostgresStore

BATCH_SIZE = 500
_BAR = 30


def run(
    database_url: str,
    keyring: Keyring,
    out: TextIO,
    batch_size: int = BATCH_SIZE,
    options: StoreOptions | None = None,
) -> tuple[int, list[tuple[int, str]], int]:
    """Re-seal everything; return how many answers and kept requests were re-sealed, the ids
    of those that could not be opened (their key is missing, or they were changed) with why, and
    how many are still not under the newest key when it ends (those, and any a gateway still
    sealing with an older key stored meanwhile)."""
    return asyncio.run(_run(database_url, keyring, out, batch_size, options))


async def _run(
    database_url: str, keyring: Keyring, out: TextIO, batch_size: int, options: StoreOptions | None
) -> tuple[int, list[tuple[int, str]], int]:
    # One connection does: the operator's ONCEGATE_STORE_* timeouts, not a gateway's pool.
    store = await PostgresStore.connect(database_url, options or StoreOptions(pool_size=1))
    done, unopenable, after = 0, [], 0
    try:
        total = await store.rekeying.rekey_remaining(keyring)
        while True:
            batch = await store.rekeying.rekey(keyring, batch_size, after)
            done += batch.resealed
            unopenable += batch.unopenable
            after = batch.last
            _progress(out, done + len(unopenable), total, keyring.current)
            if batch.done:
                break
        # The requests kept behind keys that can still turn unknown, sealed like answers.
        after = 0
        while True:
            batch = await store.rekeying.rekey_requests(keyring, batch_size, after)
            done += batch.resealed
            unopenable += batch.unopenable
            after = batch.last
            if batch.done:
                break
        left = await store.rekeying.rekey_remaining(keyring)
    finally:
        await store.close()
    if out.isatty():
        out.write("\n")
    return done, unopenable, left


def _progress(out: TextIO, done: int, total: int, key_name: str) -> None:
    """`done`: answers looked at so far (re-sealed, or found unopenable), of `total`."""
    left = max(total - done, 0)
    if out.isatty():
        filled = _BAR if total == 0 else _BAR * min(done, total) // total
        out.write(f"\r[{'#' * filled}{'.' * (_BAR - filled)}] {done}/{total} under {key_name}")
    else:
        out.write(f"looked at {done} answers for {key_name}, {left} left\n")
    out.flush()
