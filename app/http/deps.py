"""What the admin port's handlers are given: the `Runtime` the composition root
(`http.runtime`) builds, as an `Annotated` dependency (`RuntimeDep`).

The route modules (`admin`, `ui`) and the page's sessions (`sessions`) import this module; it
imports none of theirs, and neither it nor they import `http.runtime` (an import-linter contract
in pyproject.toml), so the composition root can import the routes without a circle. The runtime
holds the service's objects only: a handler reaches PostgreSQL through them, never through the
store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from .. import service
from ..service.routing import RouteTable
from ..settings import Settings


@dataclass(frozen=True, slots=True)
class Runtime:
    settings: Settings
    gateway: service.Gateway
    operator: service.Operator
    health: service.Health
    routes: RouteTable


async def get_runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
