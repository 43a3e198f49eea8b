"""Pure: which route a (normalized) path belongs to, and where its request goes upstream."""

from __future__ import annotations

from collections.abc import Sequence

from ..settings import Route


class RouteTable:
    """Longest matching prefix wins; a prefix matches whole path segments only, so `/pay`
    matches `/pay` and `/pay/x` but not `/payments`."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self._routes = sorted(routes, key=lambda route: len(route.match), reverse=True)
        self._by_name = {route.name: route for route in routes}

    def named(self, name: str) -> Route | None:
        return self._by_name.get(name)

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
        if not path.startswith("/") and (path or not _has_path(route.upstream)):
            # The path is the prefix itself: an upstream with a path of its own is that
            # resource (`/checkout/payments` -> `https://host/payments`, not `.../payments/`,
            # which an API may not serve); a bare host gets the root.
            path = "/" + path
    return route.upstream + path + ("?" + query if query else "")


def _has_path(upstream: str) -> bool:
    """Whether the upstream URL names a path below its host (settings strip its last `/`)."""
    return "/" in upstream.partition("://")[2]
