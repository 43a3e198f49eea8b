"""A Citus worker that goes away (tests/citus.py's cluster, its processes really stopped):
the keys of its shards fail closed, 503 `store-unavailable` and never forwarded; the keys of
the other worker keep working; and when it is back its keys work again, with no gateway restart.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import os
import pwd
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import asyncpg
import httpx
import pytest

from oncegate.kernel.sealing import plaintext
from oncegate.model import errors
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim
from oncegate.store import citus as citus_store
from oncegate.store import migrate
from oncegate.store.postgres import PostgresStore, workers
from tests import citus
from tests.faults.conftest import DemoUpstream, GatewayProcess, problem_name
from tests.helpers import free_port

Result = TypeVar("Result")


@pytest.fixture(scope="module")
def backend() -> str:
    return "citus"


@pytest.fixture(scope="module")
def gateway(
    module_dir: Path, database_url: str, upstream: DemoUpstream
) -> Iterator[GatewayProcess]:
    route = {"name": "mail", "match": "/", "upstream": upstream.url}
    with GatewayProcess(module_dir, database_url, [route]) as started:
        yield started


async def keys_by_worker(database_url: str, cluster: citus.Cluster, count: int) -> list[list[str]]:
    """`count` new keys on each worker's shards, in the order of `cluster.workers`."""
    ports = [worker.port for worker in cluster.workers]
    found: list[list[str]] = [[] for _ in ports]
    connection = await asyncpg.connect(database_url)
    try:
        while min(len(keys) for keys in found) < count:
            candidates = [str(uuid.uuid4()) for _ in range(50)]
            rows = await connection.fetch(
                "SELECT key, nodeport FROM unnest($1::text[]) AS key"
                " JOIN citus_shards ON shardid ="
                "  get_shard_id_for_distribution_column('oncegate_keys', key)"
                " WHERE table_name = 'oncegate_keys'::regclass",
                candidates,
            )
            for row in rows:
                keys = found[ports.index(row["nodeport"])]
                if len(keys) < count:
                    keys.append(row["key"])
    finally:
        await connection.close()
    return found


async def keys_on_and_off(
    database_url: str, port: int, other: int, count: int
) -> tuple[list[str], list[str]]:
    """`count` new keys on the shards of the worker at `port`, and `count` on the worker at
    `other` (a test of this module may have added a third, since stopped)."""
    on: list[str] = []
    off: list[str] = []
    connection = await asyncpg.connect(database_url)
    try:
        while min(len(on), len(off)) < count:
            rows = await connection.fetch(
                "SELECT key, nodeport FROM unnest($1::text[]) AS key"
                " JOIN citus_shards ON shardid ="
                "  get_shard_id_for_distribution_column('oncegate_keys', key)"
                " WHERE table_name = 'oncegate_keys'::regclass",
                [str(uuid.uuid4()) for _ in range(50)],
            )
            for row in rows:
                if row["nodeport"] in (port, other):
                    (on if row["nodeport"] == port else off).append(row["key"])
    finally:
        await connection.close()
    return on[:count], off[:count]


async def post(client: httpx.AsyncClient, key: str) -> httpx.Response:
    return await client.post("/emails", json={"to": key}, headers={"Idempotency-Key": key})


async def test_a_worker_down_fails_its_keys_closed_and_the_other_keeps_working(
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    database_url: str,
    citus_cluster: citus.Cluster,
) -> None:
    (on_down, on_up) = await keys_by_worker(database_url, citus_cluster, 3)
    down = citus_cluster.workers[0]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        answered_before = await post(client, on_down[0])
        assert answered_before.status_code == 201
        ready = await client.get(gateway.admin_url + "/readyz")
        assert ready.status_code == 200 and ready.json()["revision"] == migrate.head()
        await asyncio.to_thread(citus_cluster.stop_node, down, "immediate")
        try:
            # Still ready: the coordinator answers and the other worker's keys are served;
            # taking every gateway out of service would refuse those too.
            assert (await client.get(gateway.admin_url + "/readyz")).status_code == 200
            for key in on_down:
                refused = await post(client, key)
                assert refused.status_code == 503, refused.text
                assert problem_name(refused) == "store-unavailable"
            for key in on_up:  # the other worker's keys: forwarded once, then replayed
                first = await post(client, key)
                assert first.status_code == 201
                again = await post(client, key)
                assert again.headers["idempotent-replayed"] == "true"
        finally:
            await asyncio.to_thread(citus_cluster.start_node, down)
        # Back, with the same gateway: the refused keys are forwarded now, the answered one
        # replayed. (A moment for Citus to connect to the worker again.)
        deadline = time.monotonic() + 30
        while (response := await post(client, on_down[1])).status_code != 201:
            assert response.status_code == 503 and time.monotonic() < deadline, response.text
            await asyncio.sleep(0.2)
        assert (await post(client, on_down[2])).status_code == 201
        replay = await post(client, on_down[0])
        assert replay.headers["idempotent-replayed"] == "true"
    performed = collections.Counter(action["idempotency_key"] for action in upstream.actions())
    # Nothing of the down worker's keys was forwarded while it was down; each key once.
    assert [performed[key] for key in on_down + on_up] == [1] * 6


WORKERS = 24
BEFORE, DOWN = 1.0, 2.0
SCOPE, FINGERPRINT = hashlib.sha256(b"scope").digest(), hashlib.sha256(b"request").digest()
ANSWERS = {201, 409, 502, 503, 504}  # forwarded or replayed; the contract's problems


@pytest.mark.slow
async def test_a_worker_killed_and_restarted_under_load_performs_no_key_twice(
    gateway: GatewayProcess, upstream: DemoUpstream, citus_cluster: citus.Cluster
) -> None:
    answers: list[tuple[str, int, str]] = []
    sending = asyncio.Event()
    sending.set()
    limits = httpx.Limits(max_connections=WORKERS, keepalive_expiry=1)
    killed = citus_cluster.workers[1]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30, limits=limits) as client:

        async def worker() -> None:
            while sending.is_set():
                key = str(uuid.uuid4())
                for _ in range(2):  # each key sent twice: a retry after whatever came back
                    response = await post(client, key)
                    problem = (
                        problem_name(response)
                        if response.headers.get("content-type") == "application/problem+json"
                        else ""
                    )
                    answers.append((key, response.status_code, problem))

        workers = [asyncio.create_task(worker()) for _ in range(WORKERS)]
        try:
            await asyncio.sleep(BEFORE)
            await asyncio.to_thread(citus_cluster.stop_node, killed, "immediate")
            await asyncio.sleep(DOWN)
        finally:
            await asyncio.to_thread(citus_cluster.start_node, killed)
        restarted = len(answers)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until 100 answers in a row are all 201
            await asyncio.sleep(0.25)
            after = [status for _, status, _ in answers[restarted:]]
            if len(after) >= 100 and set(after[-100:]) == {201}:
                break
        sending.clear()
        await asyncio.gather(*workers)
    performed = collections.Counter(
        action["idempotency_key"] for action in await asyncio.to_thread(upstream.actions)
    )
    statuses = collections.Counter(status for _, status, _ in answers)
    problems = collections.Counter(problem for _, _, problem in answers if problem)
    print(  # noqa: T201 - the figures the fault suite reports (pytest -s)
        f"\nCitus worker killed under load: {len(answers)} requests by {WORKERS} clients;"
        f" statuses {dict(statuses)}; problems {dict(problems)}; keys performed"
        f" {len(performed)}, twice or more: {sum(1 for n in performed.values() if n > 1)}"
    )
    assert set(statuses) <= ANSWERS, statuses
    assert set(problems) <= {"store-unavailable", "request-in-progress", "outcome-unknown"}
    assert statuses[503] > 0  # the worker's keys really failed closed while it was down
    assert all(count == 1 for count in performed.values())  # no key performed twice
    for key, status, _ in answers:
        if status == 201:
            assert performed[key] == 1
    assert set(status for _, status, _ in answers[-100:]) == {201}  # healed, no restart


@pytest.mark.slow
async def test_a_worker_added_and_shards_rebalanced_under_light_load_lose_and_repeat_nothing(
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    database_url: str,
    citus_cluster: citus.Cluster,
) -> None:
    # A third worker, for this module's database only (Citus keeps its nodes per database).
    name = "worker-added"
    added = citus.Node(
        name, free_port(), citus_cluster.directory / name, citus_cluster.directory / f"{name}.log"
    )
    await asyncio.to_thread(citus_cluster.add_node, added)
    sent: list[tuple[str, int, str]] = []
    sending = asyncio.Event()
    sending.set()
    try:
        database = database_url.rsplit("/", 1)[1]
        connection = await asyncpg.connect(added.url("postgres"))
        try:
            await connection.execute(f"CREATE DATABASE {database}")
        finally:
            await connection.close()
        connection = await asyncpg.connect(added.url(database))
        try:
            await connection.execute("CREATE EXTENSION citus")
        finally:
            await connection.close()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:

            async def light_load() -> None:
                while sending.is_set():
                    key = str(uuid.uuid4())
                    for _ in range(2):  # forwarded, then replayed
                        response = await post(client, key)
                        sent.append((key, response.status_code, response.headers.get(
                            "idempotent-replayed", "")))  # fmt: skip
                    await asyncio.sleep(0.02)

            clients = [asyncio.create_task(light_load()) for _ in range(4)]
            coordinator = await asyncpg.connect(database_url)
            try:
                await asyncio.sleep(0.5)
                await coordinator.execute("SELECT citus_add_node('127.0.0.1', $1)", added.port)
                await coordinator.execute("SELECT citus_rebalance_start()")
                deadline = time.monotonic() + 90
                while True:
                    state = await coordinator.fetchval("SELECT state FROM citus_rebalance_status()")
                    if state == "finished":
                        break
                    assert state in ("scheduled", "running") and time.monotonic() < deadline, state
                    await asyncio.sleep(0.25)
                moved = await coordinator.fetchval(
                    "SELECT count(*) FROM citus_shards WHERE table_name = 'oncegate_keys'::regclass"
                    " AND nodeport = $1",
                    added.port,
                )
                await asyncio.sleep(0.5)  # and on, on the shards' new places
            finally:
                sending.clear()
                await asyncio.gather(*clients)
                await coordinator.close()
    finally:
        await leave_the_cluster(database_url, added)
        await asyncio.to_thread(citus_cluster.stop_node, added, "immediate")
    assert moved > 0  # shards really moved while the gateway served
    performed = collections.Counter(
        action["idempotency_key"] for action in await asyncio.to_thread(upstream.actions)
    )
    keys = {key for key, _, _ in sent}
    assert len(keys) > 20
    assert {status for _, status, _ in sent} == {201}  # nothing refused, nothing lost
    assert all(performed[key] == 1 for key in keys)  # every key performed once, none twice
    assert sum(1 for _, _, replayed in sent if replayed == "true") == len(keys)


async def leave_the_cluster(database_url: str, node: citus.Node) -> None:
    """`node`'s shards moved back to the other workers and the node removed from Citus, before
    it is stopped: the module's database is left as the test found it. A node stopped while it
    held shards, or while Citus still counted it, left the later tests a database whose keys on
    it fail and whose metadata never shows synced."""
    coordinator = await asyncpg.connect(database_url)
    try:
        listed = await coordinator.fetchval(
            "SELECT count(*) FROM pg_dist_node WHERE nodeport = $1", node.port
        )
        if listed:
            await coordinator.execute("SELECT citus_drain_node('127.0.0.1', $1)", node.port)
            await coordinator.execute("SELECT citus_remove_node('127.0.0.1', $1)", node.port)
    finally:
        await coordinator.close()


async def claimed(store: PostgresStore, key: str) -> Claim:
    """`key` claimed (a new key: won), on its worker's pools (opened by the first)."""
    found = await store.requests.claim("r", SCOPE, key, FINGERPRINT, 60, 60)
    assert isinstance(found, Claim)
    return found


async def once_it_answers(attempt: Callable[[], Awaitable[Result]]) -> Result:
    """`attempt`'s result once it no longer fails with `StoreUnavailable` (a node restarted)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await attempt()
        except errors.StoreUnavailable:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)


def outage_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str], list[str]]:
    """What the log said (warnings and above), its lines that something is unavailable, and
    those that it is back."""
    said = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    unavailable = [line for line in said if "unavailable" in line]
    return said, unavailable, [line for line in said if line.endswith(" is back")]


async def test_a_worker_down_is_said_once_as_that_worker_never_as_the_store_flapping(
    database_url: str, citus_cluster: citus.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker down while the other serves: its keys fail closed, and the log says so once,
    naming that worker, and once when it is back; it never says PostgreSQL (the coordinator,
    the store as a whole) is unavailable and back again at every request that alternates
    between the two workers' keys."""
    down, up = citus_cluster.workers[:2]
    on_down, on_up = await keys_on_and_off(database_url, down.port, up.port, 4)
    store = await PostgresStore.connect(database_url)
    try:
        for key in (on_down[0], on_up[0]):  # each worker's pools opened and used
            await claimed(store, key)
        await asyncio.to_thread(citus_cluster.stop_node, down, "immediate")
        caplog.set_level(logging.INFO, logger="oncegate")
        try:
            for refused, served in zip(on_down[1:], on_up[1:], strict=True):
                with pytest.raises(errors.StoreUnavailable):
                    await claimed(store, refused)
                await claimed(store, served)
        finally:
            await asyncio.to_thread(citus_cluster.start_node, down)
        # The worker back, with the same store: its keys claimed again.
        await once_it_answers(lambda: claimed(store, on_down[3]))
    finally:
        await store.close()
    said, unavailable, back = outage_lines(caplog)
    assert len(unavailable) == 1 and f"{down.port}" in unavailable[0], said
    assert len(back) == 1 and f"{down.port}" in back[0], said


async def test_a_worker_moved_to_a_new_address_is_followed_at_its_first_refused_connection(
    database_url: str, citus_cluster: citus.Cluster
) -> None:
    """A worker that comes back at another address (a failover to its standby, a new host),
    which the operator tells Citus with `citus_update_node`: Citus follows at once through the
    coordinator, and so must the store's direct path, rather than refuse the worker's keys
    with 503 until its next periodic read of the shard map (`citus.REFRESH_INTERVAL`)."""
    moved, other = citus_cluster.workers[:2]
    keys, _ = await keys_on_and_off(database_url, moved.port, other.port, 2)
    scope, fingerprint = hashlib.sha256(b"scope").digest(), hashlib.sha256(b"request").digest()
    store = await PostgresStore.connect(database_url)
    old, new = moved.port, free_port()
    coordinator = await asyncpg.connect(database_url)
    try:
        claimed = await store.requests.claim("r", scope, keys[0], fingerprint, 60, 60)
        assert isinstance(claimed, Claim)  # the worker's pools opened at its old address
        node = await coordinator.fetchval(
            "SELECT nodeid FROM pg_dist_node WHERE nodeport = $1", old
        )
        await asyncio.to_thread(_restart_at, citus_cluster, moved, new)
        try:
            await coordinator.execute("SELECT citus_update_node($1, '127.0.0.1', $2)", node, new)
            claimed = await store.requests.claim("r", scope, keys[1], fingerprint, 60, 60)
            assert isinstance(claimed, Claim)
            replay = await store.requests.claim("r", scope, keys[0], fingerprint, 60, 60)
            assert not isinstance(replay, Claim)  # the row claimed before the move, found
            # The pools of the old address, which the map no longer names, are forgotten (at a
            # read of the map that finds nothing in flight there: every 2 s).
            pools = store.requests._dialect.workers._pools  # type: ignore[attr-defined]
            for _ in range(100):
                if old not in {node.port for node in pools}:
                    break
                await asyncio.sleep(0.1)
            assert old not in {node.port for node in pools}
        finally:
            await asyncio.to_thread(_restart_at, citus_cluster, moved, old)
            await coordinator.execute("SELECT citus_update_node($1, '127.0.0.1', $2)", node, old)
    finally:
        await coordinator.close()
        await store.close()


def _restart_at(cluster: citus.Cluster, node: citus.Node, port: int) -> None:
    """Stop `node` and start it again listening on `port` (its data as it was)."""
    cluster.stop_node(node)
    with (node.data / "postgresql.conf").open("a") as conf:
        conf.write(f"port = {port}\n")
    node.port = port
    cluster.start_node(node)


async def test_a_worker_failed_over_while_its_old_primary_answers_read_only_is_followed(
    database_url: str, citus_cluster: citus.Cluster
) -> None:
    """A worker failed over to a copy of itself at another address (`citus_update_node`), its
    old primary still answering at the old one, demoted (read-only, as a standby): the store's
    statements there are refused, nothing written, and sent where the map, read again, says."""
    demoted, other = citus_cluster.workers[:2]
    keys, _ = await keys_on_and_off(database_url, demoted.port, other.port, 2)
    scope, fingerprint = hashlib.sha256(b"scope").digest(), hashlib.sha256(b"request").digest()
    store = await PostgresStore.connect(database_url)
    old = demoted.port
    promoted = citus.Node(
        "promoted", free_port(), citus_cluster.directory / "promoted",
        citus_cluster.directory / "promoted.log",
    )  # fmt: skip
    coordinator = await asyncpg.connect(database_url)
    try:
        claimed = await store.requests.claim("r", scope, keys[0], fingerprint, 60, 60)
        assert isinstance(claimed, Claim)  # the worker's pools opened at its old address
        node = await coordinator.fetchval(
            "SELECT nodeid FROM pg_dist_node WHERE nodeport = $1", old
        )
        await asyncio.to_thread(_fail_over, citus_cluster, demoted, promoted)
        try:
            await coordinator.execute(
                "SELECT citus_update_node($1, '127.0.0.1', $2)", node, promoted.port
            )
            claimed = await store.requests.claim("r", scope, keys[1], fingerprint, 60, 60)
            assert isinstance(claimed, Claim)
            replay = await store.requests.claim("r", scope, keys[0], fingerprint, 60, 60)
            assert not isinstance(replay, Claim)  # the row claimed before, found on the copy
        finally:
            await asyncio.to_thread(citus_cluster.stop_node, promoted)
            await asyncio.to_thread(_writable_again, citus_cluster, demoted)
            await coordinator.execute("SELECT citus_update_node($1, '127.0.0.1', $2)", node, old)
            await asyncio.to_thread(shutil.rmtree, promoted.data, True)
    finally:
        await coordinator.close()
        await store.close()


def _fail_over(cluster: citus.Cluster, node: citus.Node, promoted: citus.Node) -> None:
    """Copy `node`'s data to `promoted` (stopped: a consistent copy, as a standby promoted with
    nothing lost) and start it at its own port; start `node` again read-only, a demoted old
    primary still answering at its address."""
    cluster.stop_node(node)
    shutil.copytree(node.data, promoted.data, symlinks=True)
    with (promoted.data / "postgresql.conf").open("a") as conf:
        conf.write(f"port = {promoted.port}\n")
    (promoted.data / "postmaster.pid").unlink(missing_ok=True)
    if os.geteuid() == 0:  # the servers run as their own user (tests/citus.py)
        owner = pwd.getpwnam(citus.USER)
        for path in [promoted.data, *promoted.data.rglob("*")]:
            os.chown(path, owner.pw_uid, owner.pw_gid, follow_symlinks=False)
    cluster.start_node(promoted)
    with (node.data / "postgresql.conf").open("a") as conf:
        conf.write("default_transaction_read_only = on\n")
    cluster.start_node(node)


def _writable_again(cluster: citus.Cluster, node: citus.Node) -> None:
    cluster.stop_node(node)
    with (node.data / "postgresql.conf").open("a") as conf:
        conf.write("default_transaction_read_only = off\n")
    cluster.start_node(node)


async def test_a_worker_failed_over_whose_old_primary_comes_back_writable_gets_no_write(
    database_url: str, citus_cluster: citus.Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same failover, but the old primary starts again writable at its old address (not
    fenced: its host rebooted): the store's next connection there would take writes Citus never
    reads, and the key claimed there would be claimed again on the new primary once the map is
    read (two forwards). The map is read before a worker's connection is opened, and the claim
    goes to the new address."""
    # However fast the restarts were (raising=False: the test runs, and fails, without it).
    monkeypatch.setattr(workers, "CONNECT_REREAD", 0.0, raising=False)
    demoted, other = citus_cluster.workers[:2]
    keys, _ = await keys_on_and_off(database_url, demoted.port, other.port, 2)
    scope, fingerprint = hashlib.sha256(b"scope").digest(), hashlib.sha256(b"request").digest()
    store = await PostgresStore.connect(database_url)
    old = demoted.port
    promoted = citus.Node(
        "promoted", free_port(), citus_cluster.directory / "promoted",
        citus_cluster.directory / "promoted.log",
    )  # fmt: skip
    coordinator = await asyncpg.connect(database_url)
    try:
        claimed = await store.requests.claim("r", scope, keys[0], fingerprint, 60, 60)
        assert isinstance(claimed, Claim)  # the worker's pools opened at its old address
        node = await coordinator.fetchval(
            "SELECT nodeid FROM pg_dist_node WHERE nodeport = $1", old
        )
        await asyncio.to_thread(_fail_over, citus_cluster, demoted, promoted)
        await asyncio.to_thread(_writable_again, citus_cluster, demoted)
        try:
            await coordinator.execute(
                "SELECT citus_update_node($1, '127.0.0.1', $2)", node, promoted.port
            )
            claimed = await store.requests.claim("r", scope, keys[1], fingerprint, 60, 60)
            assert isinstance(claimed, Claim)
            seen = "SELECT count(*) FROM oncegate_keys WHERE key = $1"
            assert await coordinator.fetchval(seen, keys[1]) == 1  # where Citus reads it
            again = await store.requests.claim("r", scope, keys[1], fingerprint, 60, 60)
            assert not isinstance(again, Claim)  # held: never claimed (and forwarded) twice
        finally:
            await asyncio.to_thread(citus_cluster.stop_node, promoted)
            await coordinator.execute("SELECT citus_update_node($1, '127.0.0.1', $2)", node, old)
            await asyncio.to_thread(shutil.rmtree, promoted.data, True)
    finally:
        await coordinator.close()
        await store.close()


async def metadata_synced(database_url: str) -> None:
    """Wait until every worker has Citus's metadata synced: until then (a test before this one
    moved a worker with `citus_update_node`) the store sends its keys' claims through the
    coordinator (`citus.Shard.node` None), as it must."""
    connection = await asyncpg.connect(database_url)
    try:
        deadline = time.monotonic() + 60
        while not await connection.fetchval(
            "SELECT bool_and(hasmetadata AND metadatasynced AND isactive) FROM pg_dist_node"
            " WHERE noderole = 'primary' AND groupid <> 0"
        ):
            assert time.monotonic() < deadline, "the workers' metadata was never synced"
            await asyncio.sleep(0.2)
    finally:
        await connection.close()


async def test_the_coordinator_down_is_said_once_as_the_coordinator_while_the_workers_serve(
    database_url: str, citus_cluster: citus.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The coordinator down (its postmaster stopped, as `pg_ctl -m immediate` stops it: SIGQUIT
    to its pid), the workers up: claims and completes go straight to the workers and go on,
    what goes through the coordinator (here a read of a key) fails closed. The log says so once,
    naming the coordinator and what still works, and once when it is back; it never says the
    store forwards nothing, nor flaps at every request that alternates between the two."""
    first, second = citus_cluster.workers[:2]
    on_first, on_second = await keys_on_and_off(database_url, first.port, second.port, 4)
    coordinator = citus_cluster.coordinator
    await metadata_synced(database_url)
    store = await PostgresStore.connect(database_url)
    try:
        for key in (on_first[0], on_second[0]):  # each worker's pools opened and used
            await claimed(store, key)
        await asyncio.to_thread(citus_cluster.stop_node, coordinator, "immediate")
        caplog.set_level(logging.INFO, logger="oncegate")
        try:
            for one, other in zip(on_first[1:], on_second[1:], strict=True):
                with pytest.raises(errors.StoreUnavailable):  # through the coordinator
                    await store.requests.get(SCOPE, on_first[0])
                for key in (one, other):  # straight to each worker
                    answer = StoredAnswer(201, plaintext([], b"{}"))
                    assert await store.requests.complete(await claimed(store, key), answer)
        finally:
            await asyncio.to_thread(citus_cluster.start_node, coordinator)
        # The coordinator back, with the same store: a read through it again.
        assert await once_it_answers(lambda: store.requests.get(SCOPE, on_first[0])) is not None
    finally:
        await store.close()
    said, unavailable, back = outage_lines(caplog)
    assert len(unavailable) == 1, said
    assert f":{coordinator.port}" in unavailable[0] and "coordinator" in unavailable[0], said
    assert "forwarding nothing" not in unavailable[0] and "workers" in unavailable[0], said
    assert len(back) == 1 and f":{coordinator.port}" in back[0], said


async def test_the_coordinator_down_the_gateway_forwards_new_keys_and_says_so_once(
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    database_url: str,
    citus_cluster: citus.Cluster,
) -> None:
    """Through a gateway: the coordinator down, new keys on both workers are forwarded once and
    replayed; /healthz is 200 (the process runs), /readyz 503 (the contract's: PostgreSQL, the
    coordinator the URL names, does not answer, and the schema's revision cannot be read), and
    /metrics answers. The gateway's log says the coordinator is down once, as the coordinator,
    and once that it is back."""
    first, second = citus_cluster.workers[:2]
    on_first, on_second = await keys_on_and_off(database_url, first.port, second.port, 3)
    coordinator = citus_cluster.coordinator
    await metadata_synced(database_url)
    # The gateway's map read once more since (it reads it every REFRESH_INTERVAL).
    await asyncio.sleep(1.5 * citus_store.REFRESH_INTERVAL)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        for key in (on_first[0], on_second[0]):  # each worker's pools opened
            assert (await post(client, key)).status_code == 201
        said_before = len(gateway.process.output())
        await asyncio.to_thread(citus_cluster.stop_node, coordinator, "immediate")
        try:
            for key in on_first[1:] + on_second[1:]:
                first_answer = await post(client, key)
                assert first_answer.status_code == 201, first_answer.text
                again = await post(client, key)
                assert again.headers["idempotent-replayed"] == "true"
            assert (await client.get(gateway.admin_url + "/healthz")).status_code == 200
            ready = await client.get(gateway.admin_url + "/readyz")
            assert ready.status_code == 503 and ready.json()["status"] == "unavailable"
            assert (await client.get(gateway.admin_url + "/metrics")).status_code == 200
        finally:
            await asyncio.to_thread(citus_cluster.start_node, coordinator)
        deadline = time.monotonic() + 30
        while (await client.get(gateway.admin_url + "/readyz")).status_code != 200:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
    said = gateway.process.output()[said_before:].splitlines()
    down = [line for line in said if "(the Citus coordinator) is unavailable" in line]
    back = [line for line in said if "(the Citus coordinator) is back" in line]
    assert len(down) == 1 and len(back) == 1, said
    assert not [line for line in said if "forwarding nothing" in line], said
    performed = collections.Counter(action["idempotency_key"] for action in upstream.actions())
    assert [performed[key] for key in on_first[1:] + on_second[1:]] == [1] * 4


async def test_a_worker_down_seen_through_the_coordinator_is_not_said_as_the_coordinator(
    database_url: str, citus_cluster: citus.Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker down, the coordinator up: what the store sends through the coordinator to every
    shard (the purge, the key count) fails as Citus reports it, "connection to the remote node
    <worker> failed". That is the worker down, not the coordinator: the coordinator's `Outage`
    says nothing, or every purge would say the coordinator is unavailable and the next readiness
    probe that it is back."""
    down = citus_cluster.workers[0]
    await metadata_synced(database_url)
    store = await PostgresStore.connect(database_url)
    try:
        await asyncio.to_thread(citus_cluster.stop_node, down, "immediate")
        caplog.set_level(logging.INFO, logger="oncegate")
        try:
            for _ in range(3):
                with pytest.raises(errors.StoreUnavailable):
                    await store.upkeep.purge(100)
                assert await store.upkeep.schema_revision() == migrate.head()
        finally:
            await asyncio.to_thread(citus_cluster.start_node, down)
    finally:
        await store.close()
    said, unavailable, back = outage_lines(caplog)
    assert not unavailable and not back, said
    assert [line for line in said if f":{down.port}" in line and "could not reach" in line], said
