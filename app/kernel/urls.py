"""An http(s) URL as a log line or an error may show it (`shown`): its user information hidden
(a lone user name may be a token: `https://TOKEN@host`), its query's names without their
values, its fragment hidden.
A JWKS URL may carry its credential in the query (`?token=...`), an upstream URL refused for its
query an API key, an admin URL behind a proxy or an agent's gateway URL a password: the reader
learns that they were there, never what they are.

Database URLs have their own (`database_url.without_password`, `describe`): a libpq URL's query
holds where to connect (`host=`, `port=`), which a message must keep.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

# What a hidden value reads, as the admin API masks a kept request's credentials.
HIDDEN = "***"


def shown(url: str) -> str:
    """`url` for a message: `https://***@host/path?token=***&tenant=***#***` for
    `https://user:secret@host/path?token=abc&tenant=acme#frag`; a URL with none of these as
    given."""
    parts = urlsplit(url)
    _, at, host = parts.netloc.rpartition("@")
    netloc = f"{HIDDEN}@{host}" if at else parts.netloc
    query = "&".join(
        f"{pair.partition('=')[0]}={HIDDEN}" if "=" in pair else HIDDEN
        for pair in parts.query.split("&")
        if pair
    )
    fragment = HIDDEN if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))
