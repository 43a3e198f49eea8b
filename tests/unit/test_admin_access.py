"""Who may use each path of the admin port, read from the routes themselves: every path needs the
admin token (the API) or an operator's session (the page), but the few docs/security.md lists as
open to whoever reaches the port. A route added without its guard fails here, before any test of
its own is written. (What a refused request sees: tests/e2e/test_admin.py and
tests/faults/test_admin_surface.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from oncegate.http import admin, sessions, ui

# docs/security.md, "Whoever reaches the admin port without the token": /metrics, /healthz,
# /readyz and the page's login form (with its style sheet).
OPEN = {
    ("GET", "/metrics"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/admin/ui/style.css"),
    ("POST", "/admin/ui/login"),
}


def calls(dependant: Dependant) -> list[Callable[..., Any] | None]:
    """Every function the route runs before its own, however deep."""
    found = [dependant.call]
    for sub in dependant.dependencies:
        found += calls(sub)
    return found


def guards() -> dict[tuple[str, str], set[str]]:
    """Each (method, path) of the admin port, with the guards it runs: `token`, `session`."""
    found: dict[tuple[str, str], set[str]] = {}
    for route in [*admin.router.routes, *ui.router.routes]:
        assert isinstance(route, APIRoute)
        ran = calls(route.dependant)
        checks = (("token", admin.require_admin), ("session", sessions.require_session))
        guard = {name for name, call in checks if call in ran}
        for method in route.methods:
            found[(method, route.path)] = guard
    return found


def test_every_admin_path_but_the_open_ones_needs_the_token_or_a_session() -> None:
    found = guards()
    assert found.keys() >= OPEN  # the open ones still exist, under these names
    for path, guard in found.items():
        if path in OPEN:
            assert guard == set(), path
        elif path[1].startswith("/admin/ui"):
            assert guard == {"session"}, path  # the page: its session (the token behind it)
        else:
            assert guard == {"token"}, path  # the API: the bearer token
