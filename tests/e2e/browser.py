"""A real headless Chromium (Debian's `chromium` package), driven over the DevTools protocol.

Started with a profile of its own in a temporary directory and ended by its PID. The DevTools
socket is on loopback at a port Chromium picks (`--remote-debugging-port=0`) and writes into the
profile's `DevToolsActivePort`. Every request a page makes is recorded, so a test can check where
a page loads anything from.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

INSTALL = "apt-get install -y --no-install-recommends chromium"
STARTUP_TIMEOUT = 60.0
# A page of the admin port loads in milliseconds; the bound is for a loaded CI machine.
LOAD_TIMEOUT = 30.0
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1200,900",
)


def binary() -> str | None:
    return shutil.which("chromium")


@dataclass
class Request:
    url: str
    kind: str  # DevTools resource type: Document, Stylesheet, Script, Image, ...


@dataclass
class Tab:
    browser: Chromium
    session: str
    requests: list[Request] = field(default_factory=list)

    async def command(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.browser.command(method, params, self.session)

    async def navigate(self, url: str) -> None:
        loaded = self.browser.expect("Page.loadEventFired", self.session)
        await self.command("Page.navigate", url=url)
        await asyncio.wait_for(loaded, LOAD_TIMEOUT)

    async def evaluate(self, expression: str) -> Any:
        result = await self.command("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def submit(self, expression: str) -> None:
        """Run `expression` (which submits a form) and wait for the page it leads to."""
        loaded = self.browser.expect("Page.loadEventFired", self.session)
        await self.evaluate(expression)
        await asyncio.wait_for(loaded, LOAD_TIMEOUT)

    async def screenshot(self, path: Path) -> bytes:
        result = await self.command("Page.captureScreenshot", format="png")
        image = base64.b64decode(result["data"])
        await asyncio.to_thread(path.write_bytes, image)
        return image


class Chromium:
    def __init__(self, directory: Path) -> None:
        found = binary()
        assert found is not None
        self.profile = directory / "profile"
        self.log = directory / "chromium.log"
        self._log_file = self.log.open("ab")
        self.popen = subprocess.Popen(
            [found, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # Its own process group: its renderer and helper processes end with it.
            start_new_session=True,
        )
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._waiting: list[tuple[str, str | None, asyncio.Future[dict[str, Any]]]] = []
        self._tabs: dict[str, Tab] = {}
        self._http: aiohttp.ClientSession | None = None
        self._socket: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        port_file = self.profile / "DevToolsActivePort"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT
        while not (port_file.exists() and len(port_file.read_text().split()) == 2):
            if self.popen.poll() is not None:
                raise RuntimeError(f"chromium exited early:\n{self.log.read_text()}")
            if loop.time() > deadline:
                raise RuntimeError(f"chromium did not open DevTools:\n{self.log.read_text()}")
            await asyncio.sleep(0.1)
        port, path = port_file.read_text().split()
        self._http = aiohttp.ClientSession()
        self._socket = await self._http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._socket is not None
        async for message in self._socket:
            document = message.json()
            if "id" in document:
                future = self._pending.pop(document["id"])
                if "error" in document:
                    future.set_exception(RuntimeError(str(document["error"])))
                else:
                    future.set_result(document.get("result", {}))
                continue
            session = document.get("sessionId")
            if document["method"] == "Network.requestWillBeSent" and session in self._tabs:
                params = document["params"]
                self._tabs[session].requests.append(
                    Request(params["request"]["url"], params.get("type", ""))
                )
            for waited in list(self._waiting):
                method, wanted_session, future = waited
                if method == document["method"] and wanted_session in (None, session):
                    self._waiting.remove(waited)
                    if not future.done():
                        future.set_result(document["params"])

    def expect(self, method: str, session: str | None) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting.append((method, session, future))
        return future

    async def command(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        assert self._socket is not None
        number = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[number] = future
        message: dict[str, Any] = {"id": number, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        await self._socket.send_json(message)
        return await asyncio.wait_for(future, LOAD_TIMEOUT)

    async def new_tab(self) -> Tab:
        target = await self.command("Target.createTarget", {"url": "about:blank"})
        attached = await self.command(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        tab = Tab(self, attached["sessionId"])
        self._tabs[tab.session] = tab
        await tab.command("Page.enable")
        await tab.command("Network.enable")
        return tab

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._socket is not None:
            await self._socket.close()
        if self._http is not None:
            await self._http.close()
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        self._log_file.close()
        shutil.rmtree(self.profile, ignore_errors=True)  # tens of megabytes of browser state
