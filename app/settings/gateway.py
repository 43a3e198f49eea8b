"""`Settings`: everything `serve` needs, the parts (`parts`) and the gateway's own."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from .parts import DatabaseSettings, SealingSettings, StoreSettings
from .routes import DEFAULT_TTL, Route, check_upstream
from .units import Duration, Workers

DEFAULT_MAX_WAITERS = 1000
DEFAULT_MAX_WAITERS_PER_KEY = 64


# A TCP port; 0 asks the system for a free one.
Port = Annotated[int, Field(ge=0, le=65535)]
DEFAULT_ADMIN_PORT = 8081


class Settings(DatabaseSettings, SealingSettings, StoreSettings):
    """Everything `serve` needs, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    admin_token: str | None = None
    host: str = "127.0.0.1"
    port: Port = 8080
    admin_port: Port = DEFAULT_ADMIN_PORT
    # Worker processes; `auto`: one per core this process may use (`units.usable_cores`).
    workers: Workers = 1
    ttl: Duration = DEFAULT_TTL
    upstream: str | None = None
    log_format: Literal["json", "text"] = "json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    purge_interval: Duration = 60.0
    # How often `oncegate_keys{state}` is recounted: each gateway process tries for the key
    # count's lock this often, and the one per database holding it sweeps the table (paged).
    key_count_interval: Duration = 30.0
    # The most requests one gateway process lets wait for in-flight keys (`Prefer: wait`, a
    # route's `wait`), in all and on one key. A waiter costs a task, a little memory and a read
    # of its row every 0.5 s (2,000 reads a second at the default), and holds its client's
    # connection; past either bound a duplicate is answered at once, 409 request-in-progress
    # with Retry-After, as it would be without waiting. One key's copies beyond a few dozen
    # are a retry storm, not users, and must not take every place.
    max_waiters: int = Field(DEFAULT_MAX_WAITERS, ge=0, le=100_000)
    max_waiters_per_key: int = Field(DEFAULT_MAX_WAITERS_PER_KEY, ge=0, le=100_000)
    routes: tuple[Route, ...] = ()
    # The standard `OTEL_*` variables oncegate's tracing reads (`tracing.VARIABLES`), from the
    # environment at load: no flag or `ONCEGATE_*` variable of its own.
    otel_variables: dict[str, str] = Field(default_factory=dict)

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str | None) -> str | None:
        return check_upstream(value) if value else None

    @field_validator("routes")
    @classmethod
    def _unique_routes(cls, value: tuple[Route, ...]) -> tuple[Route, ...]:
        names = [route.name for route in value]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two routes are named {name!r}")
        matches = [route.match for route in value]
        for match in matches:
            if matches.count(match) > 1:
                raise ValueError(f"two routes match {match!r}")
        return value
