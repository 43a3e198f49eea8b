"""The loader: flags, then `ONCEGATE_*` variables, then the YAML file, merged per field and
validated once; a mistake becomes one `errors.ConfigError` line per field, named as written."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from ..model import errors
from ..telemetry import tracing
from .gateway import Settings
from .parts import default_data_dir
from .routes import DEFAULT_TIMEOUT, DEFAULT_TTL
from .units import Duration

ENV_PREFIX = "ONCEGATE_"


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
