"""Pure: the normal form of a request path (contract section 3), before anything else sees it.

Routing, the fingerprint and the upstream all see the same path, and it is the one an upstream
that normalizes paths (nginx, Go, Django, Spring, Werkzeug) would act on; otherwise `/%65mails`
or `/x/../emails` would slip past the `/emails` route's policy, and one key sent as three
spellings of one path would be performed three times.

RFC 3986 §6.2.2, in this order:
1. percent-encoded unreserved characters (letters, digits, `-._~`) are decoded, and the hex
   digits of the escapes that stay are upper-cased (`%2f` -> `%2F`); an escape that is not `%`
   and two hex digits is refused;
2. repeated slashes are merged, as nginx's `merge_slashes` does (`//a///b` -> `/a/b`);
3. dot segments are removed (§5.2.4), after step 1, so `%2E%2E` is `..` too; a `..` that would
   climb above `/` is refused rather than dropped, since no honest client sends one.
Everything else (reserved escapes like `%2F`, other bytes) passes through unchanged.

An encoded slash (`%2F`, or `%5C`, a backslash some servers take for one) is data inside a
segment to the gateway, as to nginx; but some upstreams decode it before they route. So a path
whose encoded slashes, read as slashes, would hide a dot segment is refused, and the proxy
refuses one that would then match another route (`as_slashes`).
"""

from __future__ import annotations

import re

from ..model import errors

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_ESCAPE = re.compile(r"%(.{0,2})", re.DOTALL)
_HEX = re.compile(r"[0-9A-Fa-f]{2}")
_SLASHES = re.compile(r"/{2,}")


def normalize(path: str) -> str:
    """The normal form of `path` (an origin-form request path, still percent-encoded).

    Raises `errors.InvalidPath` for a path that does not start with `/`, holds a broken escape,
    or climbs above `/`."""
    if not path.startswith("/"):
        raise errors.InvalidPath(f"the request path must start with '/': {path[:100]!r}")
    if "%" in path:
        path = _ESCAPE.sub(_escape, path)
    if "//" in path:
        path = _SLASHES.sub("/", path)
    if "." in path:
        path = _without_dot_segments(path)
    return path


def as_slashes(path: str) -> str | None:
    """The normal path with its encoded slashes read as slashes, or None when it has none.
    Raises `errors.InvalidPath` when that reading holds a dot segment or climbs."""
    if "%2F" not in path and "%5C" not in path:
        return None
    decoded = _SLASHES.sub("/", path.replace("%2F", "/").replace("%5C", "/"))
    if any(segment in (".", "..") for segment in decoded.split("/")):
        raise errors.InvalidPath(
            "the request path hides a '.' or '..' segment behind percent-encoded slashes "
            "(%2F, %5C); send the path it means"
        )
    return decoded


def _escape(match: re.Match[str]) -> str:
    digits = match.group(1)
    if not _HEX.fullmatch(digits):
        raise errors.InvalidPath(
            f"the request path holds a broken percent escape {match.group(0)!r}: '%' must be "
            "followed by two hex digits"
        )
    character = chr(int(digits, 16))
    return character if character in _UNRESERVED else "%" + digits.upper()


def _without_dot_segments(path: str) -> str:
    segments = path.split("/")[1:]  # the path starts with "/"
    kept: list[str] = []
    for segment in segments:
        if segment == "..":
            if not kept:
                raise errors.InvalidPath(
                    "the request path climbs above '/' with '..' segments; send the path it means"
                )
            kept.pop()
        elif segment != ".":
            kept.append(segment)
    # A path that ends in a dot segment names a directory: it keeps its trailing slash.
    if segments[-1] in (".", ".."):
        kept.append("")
    return "/" + "/".join(kept)
