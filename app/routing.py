"""Pure: which route a (normalized) path belongs to, and where its request goes upstream."""

from __future__ import annotations

from collections.abc import Sequence

from .settings import Route


class RouteTable:
    """Longest matching prefix wins; a prefix matches whole path segments only, so `/pay`
    matches `/pay` and `/pay/x` but not `/payments`."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self._routes = sorted(routes, key=lambda route: len(route.match), reverse=True)

    def match(self, path: str) -> Route | None:
        for route in self._routes:
            prefix = route.match
            within = prefix if prefix.endswith("/") else prefix + "/"
            if path == prefix or path.startswith(within):
                return route
        return None


def upstream_url(route: Route, path: str, query: str) -> str:
    if route.strip_prefix:
        path = path[len(route.match) :]
        if not path.startswith("/"):
            path = "/" + path
    return route.upstream + path + ("?" + query if query else "")
