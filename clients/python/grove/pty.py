"""Terminals in a sandbox: `sbx.pty.create(cols, rows)` gives a real pseudo-terminal (made by grove-init,
the command's controlling tty) whose output streams to a callback; send input, resize, kill, wait.

The terminal lives as long as its output stream (`/v1/sandboxes/{id}/pty`): `kill()`, or dropping the
handle's stream with `close()`, ends it.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Callable, Dict, Optional, Sequence, Union

from . import errors
from ._api import SseParser, sse_pairs

DataCallback = Callable[[bytes], None]


def _body(cols: int, rows: int, cmd: Union[None, str, Sequence[str]], env: Optional[Dict[str, str]], cwd: Optional[str],
          user: Optional[str]) -> dict:
    body: dict = {"cols": cols, "rows": rows}
    if isinstance(cmd, str):
        body["shell"] = cmd
    elif cmd is not None:
        body["argv"] = list(cmd)
    if env:
        body["env"] = env
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    return body


def _b64(data: Union[str, bytes]) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


class PtyHandle:
    """A running terminal: `pid`, its `output` so far, `send_input`, `resize`, `kill`, `wait`."""

    def __init__(self, sbx, on_data: Optional[DataCallback]):
        self._s = sbx
        self._on_data = on_data
        self.pid: Optional[int] = None
        self.output = bytearray()
        self.exit: Optional[dict] = None
        self._error: Optional[Exception] = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._stream = None

    def _run(self, body: dict) -> None:
        try:
            with self._s._c.stream("POST", f"/v1/sandboxes/{self._s.id}/pty", json=body, timeout=None) as r:
                self._stream = r
                if not r.is_success:
                    r.read()
                    raise errors.from_response(r.status_code, r.json())
                for event, data in sse_pairs(r.iter_lines()):
                    if event == "started":
                        self.pid = data["pid"]
                        self._started.set()
                    elif event == "data":
                        chunk = base64.b64decode(data["data"])
                        self.output.extend(chunk)
                        if self._on_data:
                            self._on_data(chunk)
                    elif event == "exit":
                        self.exit = data
                        break
                    elif event == "error":
                        raise errors.from_response(500, data)
        except Exception as e:  # surfaced by create() or wait()
            if self.exit is None and not self._done.is_set():
                self._error = e
        finally:
            self._started.set()
            self._done.set()

    def send_input(self, data: Union[str, bytes]) -> None:
        self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/pty/{self.pid}/input", json={"data": _b64(data)})

    def resize(self, cols: int, rows: int) -> None:
        self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/pty/{self.pid}/resize", json={"cols": cols, "rows": rows})

    def kill(self) -> None:
        self._s._c.request("DELETE", f"/v1/sandboxes/{self._s.id}/pty/{self.pid}")

    def wait(self, timeout: Optional[float] = None) -> dict:
        """The exit (`exit_code`, `signal`, ...) once the terminal's command ended."""
        if not self._done.wait(timeout):
            raise TimeoutError("the terminal is still running")
        if self._error is not None:
            raise self._error
        if self.exit is None:
            raise errors.ServerError("the terminal's stream ended without an exit status")
        return self.exit

    def close(self) -> None:
        """Drops the output stream, which ends the terminal."""
        if self._stream is not None:
            self._stream.close()


class Pty:
    """`sbx.pty`: terminals of a (synchronous) Sandbox."""

    def __init__(self, sbx):
        self._s = sbx

    def create(self, cols: int = 80, rows: int = 24, cmd: Union[None, str, Sequence[str]] = None, *,
               env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None, user: Optional[str] = None,
               on_data: Optional[DataCallback] = None) -> PtyHandle:
        """Starts a terminal running `cmd` (default `/bin/bash -i -l`); returns once it runs."""
        h = PtyHandle(self._s, on_data)
        threading.Thread(target=h._run, args=(_body(cols, rows, cmd, env, cwd, user),), daemon=True).start()
        h._started.wait()
        if h.pid is None:
            raise h._error or errors.ServerError("the terminal did not start")
        return h


class AsyncPtyHandle:
    """The asyncio twin of PtyHandle."""

    def __init__(self, sbx, on_data: Optional[DataCallback]):
        self._s = sbx
        self._on_data = on_data
        self.pid: Optional[int] = None
        self.output = bytearray()
        self.exit: Optional[dict] = None
        self._started: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task: Optional[asyncio.Task] = None

    async def _run(self, body: dict) -> dict:
        async with self._s._c.stream("POST", f"/v1/sandboxes/{self._s.id}/pty", json=body, timeout=None) as r:
            if not r.is_success:
                await r.aread()
                raise errors.from_response(r.status_code, r.json())
            p = SseParser()
            async for line in r.aiter_lines():
                got = p.feed(line)
                if got is not None:
                    event, data = got
                    if event == "started":
                        self.pid = data["pid"]
                        if not self._started.done():
                            self._started.set_result(self.pid)
                    elif event == "data":
                        chunk = base64.b64decode(data["data"])
                        self.output.extend(chunk)
                        if self._on_data:
                            self._on_data(chunk)
                    elif event == "exit":
                        self.exit = data
                        return data
                    elif event == "error":
                        raise errors.from_response(500, data)
        raise errors.ServerError("the terminal's stream ended without an exit status")

    async def send_input(self, data: Union[str, bytes]) -> None:
        await self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/pty/{self.pid}/input", json={"data": _b64(data)})

    async def resize(self, cols: int, rows: int) -> None:
        await self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/pty/{self.pid}/resize",
                                 json={"cols": cols, "rows": rows})

    async def kill(self) -> None:
        await self._s._c.request("DELETE", f"/v1/sandboxes/{self._s.id}/pty/{self.pid}")

    async def wait(self, timeout: Optional[float] = None) -> dict:
        assert self._task is not None
        return await asyncio.wait_for(asyncio.shield(self._task), timeout)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class AsyncPty:
    """`sbx.pty`: terminals of an AsyncSandbox."""

    def __init__(self, sbx):
        self._s = sbx

    async def create(self, cols: int = 80, rows: int = 24, cmd: Union[None, str, Sequence[str]] = None, *,
                     env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None, user: Optional[str] = None,
                     on_data: Optional[DataCallback] = None) -> AsyncPtyHandle:
        h = AsyncPtyHandle(self._s, on_data)
        h._task = asyncio.ensure_future(h._run(_body(cols, rows, cmd, env, cwd, user)))

        def fail(t: asyncio.Task) -> None:
            if not h._started.done():
                exc = t.exception() if not t.cancelled() else None
                h._started.set_exception(exc or errors.ServerError("the terminal did not start"))

        h._task.add_done_callback(fail)
        await h._started
        return h
