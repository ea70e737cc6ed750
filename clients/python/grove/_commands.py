"""Commands and background processes (as handles), written once for both clients (see `_core`)."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Union

from . import errors
from ._api import exec_body, positive_seconds
from ._core import Call, Op, Sleep, op
from ._ops import SandboxCore
from ._streams import OutputCallback
from ._transport import idempotency_headers

#: Where a background process's stdout and stderr go (grove-init's LOG_DIR).
LOG_DIR = "/run/grove/logs"


class ProcessCore:
    """A background process in a sandbox: `pid`, `wait()`, `kill()`, its output log (stdout and stderr, which
    go to `log_path` so a process nobody reads never blocks on a full pipe)."""

    def __init__(self, sbx: Any, pid: int, argv: Optional[List[str]] = None, log_path: Optional[str] = None,
                 running: bool = True):
        self._s = sbx
        self.pid = pid
        self.argv = list(argv or [])
        self.log_path = log_path or f"{LOG_DIR}/{pid}.log"
        self.running = running

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pid={self.pid}, running={self.running})"

    def __getitem__(self, k: str) -> Any:  # the dict this used to be
        return {"pid": self.pid, "argv": self.argv, "running": self.running}[k]

    @op
    def is_running(self) -> Op:
        items = (yield Call(self._s._c, "GET", f"/v1/sandboxes/{self._s.id}/processes")).json()["items"]
        me = [p for p in items if p["pid"] == self.pid]
        self.running = bool(me and me[0]["running"])
        return self.running

    @op
    def log(self, format: str = "text") -> Op:
        """Everything the process wrote so far (stdout and stderr interleaved)."""
        r = yield Call(self._s._c, "GET", f"/v1/sandboxes/{self._s.id}/files", params={"path": self.log_path},
                       timeout=None)
        return r.content if format == "bytes" else r.content.decode("utf-8", "replace")

    @op
    def wait(self, timeout: Optional[float] = None, *, interval: float = 0.2,
             on_output: Optional[OutputCallback] = None) -> Op:
        """Until the process exits (or `timeout` seconds: raises `RequestTimeout`, the process keeps running);
        returns its log. `on_output` gets the log as it grows."""
        limit = positive_seconds("timeout", timeout)
        interval = positive_seconds("interval", interval) or 0.2
        deadline = None if limit is None else time.monotonic() + limit
        seen = 0
        while True:
            running = yield from ProcessCore.is_running(self)
            if on_output is not None:
                data = yield from ProcessCore.log(self, "bytes")
                if len(data) > seen:
                    on_output(data[seen:].decode("utf-8", "replace"))
                    seen = len(data)
            if not running:
                return (yield from ProcessCore.log(self))
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.RequestTimeout(f"process {self.pid} still running after {timeout} s",
                                            code="client_timeout", field="timeout")
            yield Sleep(interval)

    @op
    def kill(self, signal: int = 9) -> Op:
        """Sends `signal` (SIGKILL by default) to the process."""
        yield Call(self._s._c, "POST", f"/v1/sandboxes/{self._s.id}/processes/{self.pid}/signal",
                   json={"signal": signal})
        if signal == 9:
            self.running = False


class CommandsCore:
    """`sbx.commands.run(...)` (E2B's spelling), background processes as handles, signals."""

    def __init__(self, sbx: Any):
        self._s = sbx

    @op
    def run(self, cmd: Union[str, Sequence[str]], *, timeout: Optional[float] = None,
            env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None, stdin: Union[None, str, bytes] = None,
            background: bool = False, on_stdout: Optional[OutputCallback] = None,
            on_stderr: Optional[OutputCallback] = None) -> Op:
        """`exec`, or with `background` a started process (its handle)."""
        if background:
            return (yield from CommandsCore.start(self, cmd, env=env, cwd=cwd))
        return (yield from SandboxCore.exec(self._s, cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin,
                                            on_stdout=on_stdout, on_stderr=on_stderr))

    @op
    def start(self, cmd: Union[str, Sequence[str]], *, env: Optional[Dict[str, str]] = None,
              cwd: Optional[str] = None) -> Op:
        """Starts a background process; returns its handle at once. Its output goes to its log."""
        body = exec_body(cmd, env=env, cwd=cwd, with_encoding=False)
        d = (yield Call(self._s._c, "POST", f"/v1/sandboxes/{self._s.id}/processes", json=body,
                        headers=idempotency_headers())).json()
        argv = list(cmd) if not isinstance(cmd, str) else ["/bin/sh", "-c", cmd]
        return self._s._process_cls(self._s, d["pid"], argv, d.get("log_path"))

    @op
    def list(self) -> Op:
        """The sandbox's background processes (running and exited), as handles."""
        items = (yield Call(self._s._c, "GET", f"/v1/sandboxes/{self._s.id}/processes")).json()["items"]
        return [self._s._process_cls(self._s, p["pid"], p.get("argv"), None, p["running"]) for p in items]

    @op
    def connect(self, pid: int) -> Op:
        """The handle of a background process started earlier (by this client or another)."""
        for p in (yield from CommandsCore.list(self)):
            if p.pid == pid:
                return p
        raise errors.NotFound(f"no background process {pid} in {self._s.id}", code="not_found", field="pid")

    @op
    def kill(self, pid: int, signal: int = 9) -> Op:
        yield Call(self._s._c, "POST", f"/v1/sandboxes/{self._s.id}/processes/{pid}/signal", json={"signal": signal})
