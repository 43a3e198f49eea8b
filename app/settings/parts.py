"""The parts of the settings that commands other than `serve` load alone (`load_part`): which
PostgreSQL, how the store is run, and the keys answers are sealed with. `Settings` has them all."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..kernel.sealing import Keyring
from ..model import errors
from . import database_url
from .units import Duration


def default_data_dir(environ: Mapping[str, str], euid: int | None = None) -> Path:
    """Where the embedded PostgreSQL keeps its data when nobody says: one place per user, never
    the working directory, so a retry cannot miss its key because the gateway was started from
    elsewhere. Root gets the system's place for service data."""
    if (os.geteuid() if euid is None else euid) == 0:
        return Path("/var/lib/oncegate")
    base = environ.get("XDG_DATA_HOME") or ""
    if not os.path.isabs(base):  # the XDG spec says to ignore a relative value
        base = os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "oncegate"


# PostgreSQL's own values of synchronous_commit, from the least durable to the most.
AnswerCommit = Literal["off", "local", "remote_write", "on", "remote_apply"]


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """How the PostgreSQL store is run (the `store_*` settings)."""

    pool_size: int = 20  # connections for claims and settles; answers get half as many more
    # The most operations one statement of the request path carries (claims, completes,
    # releases, marks as unknown, take-overs, reclaims: each kind in statements of its own). On
    # Citus a worker's claims and completes share one queue, whose statement carries up to twice
    # this of the two together, whatever the mix (128 claims alone, or completes alone).
    batch_size: int = 64
    connect_timeout: float = 5.0
    command_timeout: float = 10.0
    acquire_timeout: float = 10.0
    # PostgreSQL's synchronous_commit for storing answers (docs/operations.md, "PostgreSQL with a
    # standby"). `off` by default: one WAL flush fewer per forward, and an answer lost in a crash
    # or a failover leaves its key `unknown`, never forwarded twice (its claim is durable). `on`
    # with a synchronous standby: an answer the client got survives a failover.
    answer_commit: AnswerCommit = "off"


class DatabaseSettings(BaseModel):
    """Which PostgreSQL: `database_url`, or else the embedded one with its data in `data_dir`.
    The part of the settings that `migrate`, `purge`, `rekey` and the agent's checkpoint store
    need (`load_part`); `Settings` has it too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    database_url: str | None = None
    data_dir: Path = Field(default_factory=lambda: default_data_dir(os.environ))

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value:
            try:
                database_url.parse(value)
            except database_url.InvalidDatabaseUrl as exc:  # said without the URL: no password
                raise ValueError(str(exc)) from None
        return value or None


class SealingSettings(BaseModel):
    """The keys stored answers are sealed with (`oncegate.kernel.sealing`): `serve` and `rekey`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # `name:base64,...`: seal stored answers (oncegate.kernel.sealing). Checked at load, never
    # echoed.
    encryption_keys: str | None = None

    @field_validator("encryption_keys")
    @classmethod
    def _encryption_keys(cls, value: str | None) -> str | None:
        if value:
            try:
                Keyring.parse(value)
            except errors.ConfigError as exc:
                raise ValueError(str(exc)) from None
        return value or None

    def keyring(self) -> Keyring | None:
        return Keyring.parse(self.encryption_keys) if self.encryption_keys else None


_STORE = StoreOptions()  # the store's defaults, said once


class StoreSettings(BaseModel):
    """How the PostgreSQL store is run (`ONCEGATE_STORE_*`): for `serve`, and through
    `load_part` for the commands that open the store themselves (`purge`, `rekey`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Connections per gateway process, the most operations one statement carries, and how long
    # a request waits for PostgreSQL before it is answered 503: long enough for a busy
    # database, short enough that a dead one does not hold clients for a minute.
    store_pool_size: int = Field(_STORE.pool_size, ge=2, le=1000)
    store_batch_size: int = Field(_STORE.batch_size, ge=1, le=10000)
    store_connect_timeout: Duration = _STORE.connect_timeout
    store_command_timeout: Duration = _STORE.command_timeout
    store_acquire_timeout: Duration = _STORE.acquire_timeout
    store_answer_commit: AnswerCommit = _STORE.answer_commit

    def store_options(self, pool_size: int | None = None) -> StoreOptions:
        """The store's options; `pool_size` for a one-off command that needs fewer
        connections than a gateway (its timeouts and commit setting stay the operator's)."""
        return StoreOptions(
            pool_size=self.store_pool_size if pool_size is None else pool_size,
            batch_size=self.store_batch_size,
            connect_timeout=self.store_connect_timeout,
            command_timeout=self.store_command_timeout,
            acquire_timeout=self.store_acquire_timeout,
            answer_commit=self.store_answer_commit,
        )
