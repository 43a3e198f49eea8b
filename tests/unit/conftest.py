"""Fixtures of the one-process tests that drive the gateway's real upstream client."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from oncegate.upstream.client import HttpUpstream


@pytest.fixture
async def http_upstream() -> AsyncIterator[HttpUpstream]:
    """The gateway's own upstream client (aiohttp), closed after the test."""
    client = HttpUpstream()
    try:
        yield client
    finally:
        await client.aclose()
