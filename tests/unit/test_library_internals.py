"""What oncegate leans on inside its libraries, checked by name, so that an upgrade which moves
it fails here, saying what moved, instead of somewhere in the proxy's behaviour.

- uvicorn: `http/protocol.py` subclasses uvicorn's two HTTP/1.1 protocols and uses their private
  state (the parser, the request being parsed, the pipeline, the keep-alive timer) to hand a
  connection that offers an upgrade from httptools to h11. pyproject.toml bounds uvicorn to the
  minor versions this was checked against.
- aiohttp: `upstream/client.py` subclasses `ClientRequest` and `ClientResponse` (the session's
  `request_class` and `response_class`) and overrides `send` and `start`.

When this fails after an upgrade: read the named member in the new version, adapt the subclass,
and move the bound in pyproject.toml with it.
"""

from __future__ import annotations

import asyncio
import inspect

import aiohttp
import h11
import httptools
import pytest
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from oncegate.http import protocol


async def app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("never called")


def made(kind: type) -> object:
    config = Config(app=app, http=kind)
    config.load()
    return kind(config=config, server_state=ServerState(), app_state={},
                _loop=asyncio.get_running_loop())  # fmt: skip


# Methods protocol.py overrides or calls, by class.
HTTPTOOLS_METHODS = ["connection_made", "connection_lost", "data_received", "eof_received",
                     "on_message_begin", "on_headers_complete", "on_body", "on_message_complete",
                     "on_response_complete", "send_400_response",
                     "_unset_keepalive_if_required"]  # fmt: skip
H11_METHODS = ["connection_made", "data_received", "eof_received", "connection_lost",
               "_unsupported_upgrade_warning"]  # fmt: skip
# State protocol.py reads on an instance (`transport`: replaced by `_JoinedWrites`).
HTTPTOOLS_STATE = ["parser", "pipeline", "connections", "cycle", "loop", "logger", "transport"]
H11_STATE = ["conn", "cycle", "loop", "transport"]


@pytest.mark.parametrize(
    ("kind", "methods"), [(HttpToolsProtocol, HTTPTOOLS_METHODS), (H11Protocol, H11_METHODS)]
)
def test_the_uvicorn_methods_the_protocols_override_are_there(
    kind: type, methods: list[str]
) -> None:
    for name in methods:
        assert callable(getattr(kind, name, None)), f"uvicorn {kind.__name__}.{name} moved"
    parameters = list(inspect.signature(kind.__init__).parameters)
    assert parameters[:4] == ["self", "config", "server_state", "app_state"], parameters


@pytest.mark.parametrize(
    ("kind", "state"), [(HttpToolsProtocol, HTTPTOOLS_STATE), (H11Protocol, H11_STATE)]
)
async def test_the_uvicorn_state_the_protocols_read_is_there(kind: type, state: list[str]) -> None:
    instance = made(kind)
    for name in state:
        assert hasattr(instance, name), f"uvicorn {kind.__name__} has no {name!r} any more"


async def test_the_httptools_parser_still_says_upgrade_the_way_the_hand_over_reads_it() -> None:
    instance = made(HttpToolsProtocol)
    parser = instance.parser  # type: ignore[attr-defined]
    for name in ("should_upgrade", "get_method", "get_http_version", "feed_data"):
        assert callable(getattr(parser, name, None)), f"httptools parser: no {name}"
    # The hand-over keeps what follows the head: httptools says where that starts.
    head = b"POST / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
    with pytest.raises(httptools.HttpParserUpgrade) as raised:
        httptools.HttpRequestParser(object()).feed_data(head + b"body")
    assert raised.value.args[0] == len(head)
    assert h11.IDLE is not None


async def test_the_protocols_of_both_ports_are_still_built_on_them() -> None:
    # The subclasses themselves construct: uvicorn's constructor still takes what they pass on.
    assert isinstance(made(protocol.HttpProtocol), HttpToolsProtocol)
    assert isinstance(made(protocol.IgnoringUpgradesH11), H11Protocol)


def test_the_aiohttp_methods_the_upstream_client_overrides_are_there() -> None:
    assert list(inspect.signature(aiohttp.ClientRequest.send).parameters) == ["self", "conn"]
    assert list(inspect.signature(aiohttp.ClientResponse.start).parameters) == [
        "self", "connection"
    ]  # fmt: skip
    assert "request_class" in inspect.signature(aiohttp.ClientSession).parameters
    assert "response_class" in inspect.signature(aiohttp.ClientSession).parameters
