"""Shell sessions: named long-lived shells in a sandbox whose state (cwd, exported variables, an activated
venv, aliases, functions, background jobs) carries from one `run` to the next, and into every branch of a
fork.

    main = sbx.sessions.create("main")
    main.run("cd /src && source .venv/bin/activate")
    print(main.run("pytest -q", timeout=600).output)

`AsyncSessions` / `AsyncSession` are the same over the async client (`await`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional
from urllib.parse import quote

from ._api import http_timeout


@dataclass
class SessionRunResult:
    """One run: merged stdout+stderr and the shell's `$?` (130 after an interrupt or a timeout)."""
    output: str
    exit_code: Optional[int]
    timed_out: bool
    interrupted: bool
    session_alive: bool
    output_truncated: bool
    duration_ms: int
    signal: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_json(cls, d: dict) -> "SessionRunResult":
        return cls(output=d["output"], exit_code=d.get("exit_code"), timed_out=d["timed_out"],
                   interrupted=d["interrupted"], session_alive=d["session_alive"],
                   output_truncated=d["output_truncated"], duration_ms=d["duration_ms"], signal=d.get("signal"))


def _base(sandbox_id: str) -> str:
    return f"/v1/sandboxes/{sandbox_id}/sessions"


def _path(sandbox_id: str, name: str) -> str:
    return f"{_base(sandbox_id)}/{quote(name, safe='')}"


def _create_body(name: str, shell: Optional[str], env: Optional[Dict[str, str]], cwd: Optional[str]) -> dict:
    body: Dict[str, Any] = {"name": name}
    if shell is not None:
        body["shell"] = shell
    if env:
        body["env"] = env
    if cwd is not None:
        body["cwd"] = cwd
    return body


def _run_body(command: str, timeout: Optional[float], input: Optional[str], max_output_bytes: Optional[int]) -> dict:
    body: Dict[str, Any] = {"command": command}
    if timeout is not None:
        body["timeout_ms"] = max(1, int(timeout * 1000))
    if input is not None:
        body["input"] = input
    if max_output_bytes is not None:
        body["max_output_bytes"] = max_output_bytes
    return body


class Session:
    """A named shell in a sandbox (see `Sessions.create`)."""

    def __init__(self, sbx: Any, info: dict):
        self._s = sbx
        self.info = info

    @property
    def name(self) -> str:
        return self.info["name"]

    def run(self, command: str, *, timeout: Optional[float] = None, input: Optional[str] = None,
            max_output_bytes: Optional[int] = None) -> SessionRunResult:
        """Runs `command` in the shell; `timeout` (seconds) interrupts the command, not the session."""
        r = self._s._c.request("POST", _path(self._s.id, self.name) + "/run",
                               json=_run_body(command, timeout, input, max_output_bytes),
                               timeout=http_timeout(timeout))
        return SessionRunResult.from_json(r.json())

    def interrupt(self) -> None:
        self._s._c.request("POST", _path(self._s.id, self.name) + "/interrupt")

    def refresh(self) -> dict:
        self.info = self._s._c.request("GET", _path(self._s.id, self.name)).json()
        return self.info

    def is_alive(self) -> bool:
        return bool(self.refresh()["alive"])

    def close(self) -> None:
        self._s._c.request("DELETE", _path(self._s.id, self.name))

    def __repr__(self) -> str:
        return f"Session({self._s.id}/{self.name})"


class Sessions:
    """`sbx.sessions`: create, get, list."""

    def __init__(self, sbx: Any):
        self._s = sbx

    def create(self, name: str, *, shell: Optional[str] = None, env: Optional[Dict[str, str]] = None,
               cwd: Optional[str] = None) -> Session:
        info = self._s._c.request("POST", _base(self._s.id), json=_create_body(name, shell, env, cwd)).json()
        return Session(self._s, info)

    def get(self, name: str) -> Session:
        return Session(self._s, self._s._c.request("GET", _path(self._s.id, name)).json())

    def list(self) -> List[Session]:
        d = self._s._c.request("GET", _base(self._s.id)).json()
        return [Session(self._s, i) for i in d["sessions"]]


class AsyncSession:
    """The async twin of `Session`."""

    def __init__(self, sbx: Any, info: dict):
        self._s = sbx
        self.info = info

    @property
    def name(self) -> str:
        return self.info["name"]

    async def run(self, command: str, *, timeout: Optional[float] = None, input: Optional[str] = None,
                  max_output_bytes: Optional[int] = None) -> SessionRunResult:
        r = await self._s._c.request("POST", _path(self._s.id, self.name) + "/run",
                                     json=_run_body(command, timeout, input, max_output_bytes),
                                     timeout=http_timeout(timeout))
        return SessionRunResult.from_json(r.json())

    async def interrupt(self) -> None:
        await self._s._c.request("POST", _path(self._s.id, self.name) + "/interrupt")

    async def refresh(self) -> dict:
        self.info = (await self._s._c.request("GET", _path(self._s.id, self.name))).json()
        return self.info

    async def is_alive(self) -> bool:
        return bool((await self.refresh())["alive"])

    async def close(self) -> None:
        await self._s._c.request("DELETE", _path(self._s.id, self.name))

    def __repr__(self) -> str:
        return f"AsyncSession({self._s.id}/{self.name})"


class AsyncSessions:
    """`sbx.sessions` on an `AsyncSandbox`."""

    def __init__(self, sbx: Any):
        self._s = sbx

    async def create(self, name: str, *, shell: Optional[str] = None, env: Optional[Dict[str, str]] = None,
                     cwd: Optional[str] = None) -> AsyncSession:
        r = await self._s._c.request("POST", _base(self._s.id), json=_create_body(name, shell, env, cwd))
        return AsyncSession(self._s, r.json())

    async def get(self, name: str) -> AsyncSession:
        return AsyncSession(self._s, (await self._s._c.request("GET", _path(self._s.id, name))).json())

    async def list(self) -> List[AsyncSession]:
        d = (await self._s._c.request("GET", _base(self._s.id))).json()
        return [AsyncSession(self._s, i) for i in d["sessions"]]
