"""Settings: flags, then `ONCEGATE_*` variables, then the YAML file (contract sections 2 and 3).

Built once at the edge (`load`) and passed down; nothing reads the environment after that (the
`OTEL_*` variables tracing uses are read here too, as `otel_variables`; only OpenTelemetry's SDK,
once tracing starts, reads its own others).
Every value is validated before anything starts, and a bad one raises `errors.ConfigError` with
a message that names the field (`routes[1].ttl: ...`), never a traceback.

Precedence is per field: a flag beats its variable, which beats the file. Route entries live only
in the file; `ttl` at the top level (or `--ttl`) is the default for routes that set none.

The rooms: `units` (durations and sizes), `routes` (a route's options), `parts` (which
PostgreSQL, how the store is run, the sealing keys: what `load_part` loads alone), `gateway`
(`Settings`, everything `serve` needs) and `loader` (`load`, `load_part`). Import the names from
here (`from oncegate import settings`).
"""

from .gateway import (
    DEFAULT_ADMIN_PORT,
    DEFAULT_MAX_WAITERS,
    DEFAULT_MAX_WAITERS_PER_KEY,
    Port,
    Settings,
)
from .loader import ENV_PREFIX, load, load_part
from .parts import (
    AnswerCommit,
    DatabaseSettings,
    SealingSettings,
    StoreOptions,
    StoreSettings,
    default_data_dir,
)
from .routes import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_MAX_WAIT,
    DEFAULT_TIMEOUT,
    DEFAULT_TTL,
    ROUTE_NAME,
    UNUSABLE_KEY_HEADERS,
    Route,
    TokenScope,
    check_upstream,
)
from .units import MAX_DURATION, Duration, Size, Wait, parse_duration, parse_size

__all__ = [
    "DEFAULT_ADMIN_PORT",
    "DEFAULT_BODY_LIMIT",
    "DEFAULT_MAX_WAIT",
    "DEFAULT_MAX_WAITERS",
    "DEFAULT_MAX_WAITERS_PER_KEY",
    "DEFAULT_TIMEOUT",
    "DEFAULT_TTL",
    "ENV_PREFIX",
    "MAX_DURATION",
    "ROUTE_NAME",
    "UNUSABLE_KEY_HEADERS",
    "AnswerCommit",
    "DatabaseSettings",
    "Duration",
    "Port",
    "Route",
    "SealingSettings",
    "Settings",
    "Size",
    "StoreOptions",
    "StoreSettings",
    "TokenScope",
    "Wait",
    "check_upstream",
    "default_data_dir",
    "load",
    "load_part",
    "parse_duration",
    "parse_size",
]
