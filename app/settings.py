"""Settings: flags, then `ONCEGATE_*` variables, then the YAML file (contract sections 2 and 3).

Built once at the edge (`load`) and passed down; nothing reads the environment after that (the
`OTEL_*` variables tracing uses are read here too, as `otel_variables`; only OpenTelemetry's SDK,
once tracing starts, reads its own others).
Every value is validated before anything starts, and a bad one raises `errors.ConfigError` with
a message that names the field (`routes[1].ttl: ...`), never a traceback.

Precedence is per field: a flag beats its variable, which beats the file. Route entries live only
in the file; `ttl` at the top level (or `--ttl`) is the default for routes that set none.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from . import database_url, errors, headers, keys, tracing
from .sealing import Keyring

ENV_PREFIX = "ONCEGATE_"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}


def parse_duration(value: object) -> float:
    """`90s`, `15m`, `24h`, `7d`, `250ms` or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like 90s, 15m, 24h, 7d")
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(
            f"{value!r} is not a duration: use a number of seconds or 90s, 15m, 24h, 7d"
        )
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def parse_size(value: object) -> int:
    """`512KiB`, `10MiB` or a number of bytes -> bytes."""
    if isinstance(value, bool):
        raise ValueError("a size is a number of bytes or a string like 512KiB, 10MiB")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size: use a number of bytes or 512KiB, 10MiB")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


# Ten years: longer than any key should live, and far inside PostgreSQL's interval range.
MAX_DURATION = 3650 * 86400.0
Duration = Annotated[
    float, BeforeValidator(parse_duration), Field(gt=0, le=MAX_DURATION, allow_inf_nan=False)
]
Size = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
# A wait may be none at all (`0s`).
Wait = Annotated[
    float, BeforeValidator(parse_duration), Field(ge=0, le=MAX_DURATION, allow_inf_nan=False)
]

DEFAULT_TTL = 24 * 3600.0
DEFAULT_TIMEOUT = 30.0
DEFAULT_BODY_LIMIT = 10 * 1024**2
DEFAULT_MAX_WAIT = 10.0
DEFAULT_MAX_WAITERS = 1000
DEFAULT_MAX_WAITERS_PER_KEY = 64
_METHOD = re.compile(r"^[A-Z]+$")
# A route name: a metric label, a log field and the admin API's `route=`.
ROUTE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
KEY_HEADER = "Idempotency-Key"
# What a `key_header` cannot be, besides hop-by-hop fields and the route's scope headers:
# fields the gateway or the HTTP layers below it read, set or rewrite (the client's request
# head, its body's description, credentials, `Prefer`, the request id, trace context), so a
# key there would not reach the upstream as sent, or would mean two things at once.
UNUSABLE_KEY_HEADERS = frozenset(
    {
        "content-type",
        "content-encoding",
        "authorization",
        "cookie",
        headers.PREFER,
        headers.REQUEST_ID,
        "traceparent",
        "tracestate",
    }
)


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


def _check_upstream(value: str) -> str:
    parts = urlsplit(value)
    if "@" in parts.netloc:
        # Credentials in the URL would be logged with every route line and mixed into requests
        # that carry their own Authorization; the upstream's credentials are the client's job.
        # The message shows the URL without them.
        shown = parts._replace(netloc="…@" + parts.netloc.rpartition("@")[2]).geturl()
        raise ValueError(
            f"{shown!r}: an upstream URL must not carry credentials (user:password@); let "
            "clients send their own Authorization header"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r}: an upstream URL takes no query or fragment")
    return value.rstrip("/")


class Route(BaseModel):
    """One `routes:` entry. Defaults are the contract's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    match: str
    upstream: str
    strip_prefix: bool = False
    methods: frozenset[str] = frozenset({"POST", "PATCH"})
    key: Literal["required", "optional"] = "required"
    ttl: Duration = DEFAULT_TTL
    timeout: Duration = DEFAULT_TIMEOUT
    lease: Duration | None = None
    max_body: Size = DEFAULT_BODY_LIMIT
    max_stored_response: Size = DEFAULT_BODY_LIMIT
    scope_headers: tuple[str, ...] = Field(("Authorization",), validate_default=True)
    release_statuses: frozenset[int] = frozenset({429, 503})
    on_unknown: Literal["reject", "forward"] = "reject"
    # The longest a request with `Prefer: wait=N` waits for its key to settle (contract section 9).
    max_wait: Duration = DEFAULT_MAX_WAIT
    # `status_only`: keep the status and headers of answers, not their bodies (for APIs whose
    # answers must not be kept); a replay then has an empty body.
    store: Literal["full", "status_only"] = "full"
    # Where the key is (contract section 10): a header of another name (`PayPal-Request-Id`),
    # passed upstream under that name, or a string field of a JSON body, named by an RFC 6901
    # pointer (`/idempotency_key`). Unset: the `Idempotency-Key` header.
    key_header: str | None = None
    key_from_body: str | None = None
    # How long a duplicate of an in-flight key waits for its answer without asking (`Prefer:
    # wait`), so clients that retry on their own timeout get the replay instead of 409.
    wait: Wait = 0.0

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not ROUTE_NAME.match(value):
            raise ValueError(
                f"{value!r}: a route name is 1-64 letters, digits, '.', '_' or '-' "
                "(it becomes a metric label)"
            )
        return value

    @field_validator("match")
    @classmethod
    def _match(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r}: a path prefix starts with '/'")
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str) -> str:
        return _check_upstream(value)

    @field_validator("methods", mode="before")
    @classmethod
    def _methods(cls, value: object) -> object:
        if isinstance(value, str):  # `methods: POST` or `methods: POST, PATCH`
            value = [part.strip() for part in value.split(",")]
        if isinstance(value, list | tuple | set | frozenset):
            methods = [str(method).upper() for method in value]
            for method in methods:
                if not _METHOD.match(method):
                    raise ValueError(f"{method!r} is not an HTTP method")
            return frozenset(methods)
        raise ValueError(f"a list of HTTP methods, like [POST, PATCH], not {value!r}")

    @field_validator("scope_headers")
    @classmethod
    def _scope_headers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not _HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a header name")
        return tuple(name.lower() for name in value)

    @field_validator("release_statuses")
    @classmethod
    def _release_statuses(cls, value: frozenset[int]) -> frozenset[int]:
        for status in value:
            if not 100 <= status <= 599:
                raise ValueError(f"{status} is not an HTTP status code")
        return value

    @field_validator("key_header")
    @classmethod
    def _key_header(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not _HEADER_NAME.match(value):
            raise ValueError(f"{value!r} is not a header name")
        lowered = value.lower()
        if lowered in headers.HOP_BY_HOP or lowered in headers.REQUEST_ONLY:
            raise ValueError(
                f"{value!r} is a hop-by-hop or connection field: it never reaches the upstream, "
                "so it cannot carry a key"
            )
        if lowered in UNUSABLE_KEY_HEADERS:
            raise ValueError(
                f"{value!r} means something else to the gateway or to HTTP; name the header "
                "your API takes its key in (e.g. PayPal-Request-Id)"
            )
        return value

    @field_validator("key_from_body")
    @classmethod
    def _key_from_body(cls, value: str | None) -> str | None:
        if value is not None:
            keys.parse_pointer(value)  # its ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _where_the_key_is(self) -> Route:
        if self.key_header is not None and self.key_from_body is not None:
            raise ValueError(
                "key_header and key_from_body both say where the key is; a route takes one"
            )
        if self.key_header is not None and self.key_header.lower() in self.scope_headers:
            raise ValueError(
                f"key_header {self.key_header!r} is also a scope header: every key would be a "
                "scope of its own"
            )
        return self

    @model_validator(mode="after")
    def _wait(self) -> Route:
        if self.wait > self.max_wait:
            raise ValueError(
                f"wait ({self.wait:g}s) exceeds max_wait ({self.max_wait:g}s), the longest a "
                "client may ask to wait with Prefer: wait; raise max_wait too"
            )
        return self

    @property
    def key_header_shown(self) -> str:
        """The header the key is in, as the route spells it (`key_header`, else
        `Idempotency-Key`): for messages."""
        return self.key_header or KEY_HEADER

    @functools.cached_property
    def key_header_name(self) -> str:
        """The header the key is in, lower case, as requests' header names are."""
        return self.key_header_shown.lower()

    @functools.cached_property
    def key_pointer(self) -> tuple[str, ...] | None:
        """`key_from_body`'s reference tokens, or None when the key is in a header."""
        return None if self.key_from_body is None else keys.parse_pointer(self.key_from_body)

    @model_validator(mode="after")
    def _lease_and_ttl(self) -> Route:
        if self.lease_seconds <= self.timeout:
            raise ValueError(
                f"lease ({self.lease_seconds:g}s) must exceed timeout ({self.timeout:g}s), or a "
                "second request could be forwarded while the first is still in flight"
            )
        if self.ttl <= self.lease_seconds:
            source = "" if self.lease is not None else ", twice the timeout"
            raise ValueError(
                f"ttl ({self.ttl:g}s) must exceed lease ({self.lease_seconds:g}s{source}): a key "
                "cannot expire while its request is still in flight"
            )
        return self

    @property
    def lease_seconds(self) -> float:
        """How long a claim is held. By default twice the timeout: an in-flight claim must
        outlive the upstream call it guards, or a second gateway could take the key over while
        the first is still waiting for the answer."""
        return self.lease if self.lease is not None else 2 * self.timeout


# PostgreSQL's own values of synchronous_commit, from the least durable to the most.
AnswerCommit = Literal["off", "local", "remote_write", "on", "remote_apply"]


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """How the PostgreSQL store is run (the `store_*` settings)."""

    pool_size: int = 20  # connections for claims and settles; answers get half as many more
    batch_size: int = 64  # the most operations one statement carries
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
    """The keys stored answers are sealed with (`oncegate.sealing`): `serve` and `rekey`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # `name:base64,...`: seal stored answers (oncegate.sealing). Checked at load, never echoed.
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


class Settings(DatabaseSettings, SealingSettings, StoreSettings):
    """Everything `serve` needs, validated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    admin_token: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    admin_port: int = Field(8081, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64)
    ttl: Duration = DEFAULT_TTL
    upstream: str | None = None
    log_format: Literal["json", "text"] = "json"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    purge_interval: Duration = 60.0
    # How often each gateway process recounts `oncegate_keys{state}` (a paged sweep of the table).
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
        return _check_upstream(value) if value else None

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


def load(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> Settings:
    """Build the settings from flags (given ones only), `ONCEGATE_*` variables and the file."""
    flags = {name: value for name, value in (flags or {}).items() if value is not None}
    environ = os.environ if environ is None else environ
    path = config_file or flags.pop("config", None) or environ.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = _read_file(Path(path)) if path else {}
    fields = set(Settings.model_fields) - {"routes", "otel_variables"}
    merged.update(_variables(fields, environ))
    merged.update({name: value for name, value in flags.items() if name in fields})
    merged.setdefault("data_dir", default_data_dir(environ))
    merged["otel_variables"] = tracing.variables(environ)
    default_ttl = merged.get("ttl", DEFAULT_TTL)
    try:
        TypeAdapter(Duration).validate_python(default_ttl)
    except ValidationError:
        default_ttl = DEFAULT_TTL  # its mistake is said once, as `ttl`'s, not again per route
    routes = merged.get("routes") or []
    if not isinstance(routes, list):
        raise errors.ConfigError(f"{path}: routes: must be a list of routes")
    # A route that sets no ttl takes the top-level one; done before validation so the lease and
    # ttl checks see the value that will be used.
    merged["routes"] = [
        {"ttl": default_ttl, **route} if isinstance(route, dict) else route for route in routes
    ]
    if merged.get("upstream"):
        if any(isinstance(route, dict) and route.get("name") == "default" for route in routes):
            raise errors.ConfigError("--upstream adds a route named 'default'; the file has one")
        merged["routes"].append(
            {"name": "default", "match": "/", "upstream": merged["upstream"], "ttl": default_ttl}
        )
    try:
        settings = Settings.model_validate(merged)
    except ValidationError as exc:
        added = len(routes) if merged.get("upstream") else None
        raise errors.ConfigError(_describe(exc, path, added)) from None
    if not settings.routes:
        raise errors.ConfigError(
            "no routes: give --upstream URL (one catch-all route) or --config FILE with routes"
        )
    return settings


Part = TypeVar("Part", bound=BaseModel)


def load_part(part: type[Part], environ: Mapping[str, str] | None = None) -> Part:
    """One part of the settings (`DatabaseSettings`, `SealingSettings`, `StoreSettings`) from its
    `ONCEGATE_*` variables alone, for the commands that need no routes and read no file."""
    environ = os.environ if environ is None else environ
    merged: dict[str, Any] = _variables(set(part.model_fields), environ)
    if "data_dir" in part.model_fields:
        merged.setdefault("data_dir", default_data_dir(environ))
    try:
        return part.model_validate(merged)
    except ValidationError as exc:
        raise errors.ConfigError(_describe(exc, None)) from None


def _variables(fields: set[str], environ: Mapping[str, str]) -> dict[str, str]:
    """The `ONCEGATE_*` variable of each field that has one set (an empty one counts as unset)."""
    found = {name: environ.get(ENV_PREFIX + name.upper()) for name in fields}
    return {name: value for name, value in found.items() if value}


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise errors.ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        # PyYAML's own text names the stream "<unicode string>"; say the file, line and column.
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        raise errors.ConfigError(
            f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")
        ) from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise errors.ConfigError(f"{path}: the top level must be a mapping (routes: ...)")
    return document


def _describe(exc: ValidationError, path: object, added: int | None = None) -> str:
    """One line per mistake, named as the user wrote it. `added` is the index of the route
    that `upstream` (--upstream) adds: its mistakes are the flag's, not a `routes[N]` the user
    never wrote, and a bad URL is said once, not once for the setting and once for the route."""
    lines: list[str] = []
    for error in exc.errors():
        parts = list(error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field (a typo?)"
        prefix = ""
        if added is not None and parts[:2] == ["routes", added]:
            if parts[2:] == ["upstream"]:
                continue  # the same mistake as `upstream` itself, said there
            prefix, parts = "the route 'default' that upstream (--upstream) adds", parts[2:]
            if "must exceed lease" in message:
                message += (
                    f"; that route has the default timeout ({DEFAULT_TIMEOUT:g}s) and lease "
                    f"(twice it), which only a config file can change (routes: with its own "
                    "timeout or lease): give a longer ttl, or write the route in a file"
                )
        location = "".join(
            f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts
        ).lstrip(".")
        if prefix:
            location = f"{prefix} ({location})" if location else prefix
        lines.append(f"  {location or 'settings'}: {message}")
    source = f" in {path}" if path else ""
    return f"invalid configuration{source}:\n" + "\n".join(lines)
