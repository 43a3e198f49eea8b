"""The library peer of bench/run.py: idemkit 1.0.2 on PostgreSQL, mounted on the bare proxy.

`bare_proxy.create_app` (uvicorn, the same application stack, the gateway's upstream client)
with idemkit's ASGI `IdempotencyMiddleware` in front of it, on idemkit's `PostgresBackend`,
configured as close to the gateway's defaults as idemkit allows:

- POST and PATCH under control (idemkit's default), a missing key refused
  (`require_key_for_mutations`, like the gateway's `key: required`);
- keys scoped by the Authorization header, like the gateway's default `scope_headers`; the
  extractor returns a non-empty value without one, because idemkit refuses a request whose
  configured extractor yields nothing;
- the gateway's lease (60 s) and TTL (24 h);
- everything else idemkit's defaults: its table and indexes (`init_pg`, run at start-up, is
  idempotent), its pool (4 to 20 connections, asyncpg's reset on release), no local cache.

    .venv/bin/python bench/idemkit_proxy.py --upstream http://127.0.0.1:9000 --port 8091 \
        --database-url postgresql://...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

import bare_proxy
from idemkit import HttpConfig, IdempotencyMiddleware, PostgresBackend
from idemkit.backends.postgres import init_pg

DATABASE_VARIABLE = "BENCH_DATABASE_URL"
LEASE_SECONDS = 60.0
TTL_SECONDS = 24 * 3600.0


def scope(request: Any) -> str:
    """`request` is idemkit's request proxy: `headers` is a case-insensitive dict."""
    return "authorization:" + (request.headers.get("authorization") or "")


def create_app(upstream_url: str, database_url: str, stack: str = "asgi") -> Any:
    # Wrapping the application is what `add_middleware` does, and works for both stacks.
    return IdempotencyMiddleware(
        bare_proxy.create_app(upstream_url, stack),
        backend=PostgresBackend.from_url(database_url),
        config=HttpConfig(
            scope=scope,
            require_key_for_mutations=True,
            lease_ttl_seconds=LEASE_SECONDS,
            expires_after_seconds=TTL_SECONDS,
        ),
    )


def from_environment() -> Any:
    return create_app(
        os.environ[bare_proxy.UPSTREAM_VARIABLE],
        os.environ[DATABASE_VARIABLE],
        os.environ.get(bare_proxy.STACK_VARIABLE, "asgi"),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, metavar="URL")
    parser.add_argument("--database-url", required=True, metavar="URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--stack", choices=["asgi", "fastapi"], default="asgi")
    arguments = parser.parse_args()
    asyncio.run(init_pg(arguments.database_url))
    os.environ[bare_proxy.UPSTREAM_VARIABLE] = arguments.upstream
    os.environ[DATABASE_VARIABLE] = arguments.database_url
    os.environ[bare_proxy.STACK_VARIABLE] = arguments.stack
    bare_proxy.serve(
        "idemkit_proxy:from_environment", arguments.host, arguments.port, arguments.workers
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
