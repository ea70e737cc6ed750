"""The asyncio API: `AsyncSandbox` and `AsyncSnapshot`, method for method like the sync ones."""

from __future__ import annotations

import base64
from typing import Callable, Dict, List, Optional, Sequence, Union
from urllib.parse import quote

from . import errors
from ._api import (EntryInfo, ExecResult, Network, SandboxInfo, SseParser, batch_split, create_body, exec_body,
                   http_timeout, list_params, parse_entries, parse_exec)
from ._transport import AsyncClient, default_async_client, idempotency_headers
from .sandbox import DEFAULT_IMAGE

OutputCallback = Callable[[str], None]


def _q(s: str) -> str:
    return quote(s, safe="")


class AsyncCommands:
    def __init__(self, sbx: "AsyncSandbox"):
        self._s = sbx

    async def run(self, cmd: Union[str, Sequence[str]], *, timeout: Optional[float] = None,
                  env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None, stdin: Union[None, str, bytes] = None,
                  background: bool = False, on_stdout: Optional[OutputCallback] = None,
                  on_stderr: Optional[OutputCallback] = None):
        if background:
            return await self.start(cmd, env=env, cwd=cwd)
        return await self._s.exec(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin, on_stdout=on_stdout,
                                  on_stderr=on_stderr)

    async def start(self, cmd: Union[str, Sequence[str]], *, env: Optional[Dict[str, str]] = None,
                    cwd: Optional[str] = None) -> int:
        body = exec_body(cmd, env=env, cwd=cwd, with_encoding=False)
        return (await self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/processes", json=body)).json()["pid"]

    async def list(self) -> List[dict]:
        return (await self._s._c.request("GET", f"/v1/sandboxes/{self._s.id}/processes")).json()["items"]

    async def kill(self, pid: int, signal: int = 9) -> None:
        await self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/processes/{pid}/signal", json={"signal": signal})


class AsyncFiles:
    def __init__(self, sbx: "AsyncSandbox"):
        self._s = sbx

    async def read(self, path: str, format: str = "text") -> Union[str, bytes]:
        data = (await self._s._c.request("GET", f"/v1/sandboxes/{self._s.id}/files", params={"path": path})).content
        return data if format == "bytes" else data.decode("utf-8", "replace")

    async def write(self, path: str, data: Union[str, bytes], mode: Optional[int] = None) -> None:
        params = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        content = data.encode() if isinstance(data, str) else data
        await self._s._c.request("PUT", f"/v1/sandboxes/{self._s.id}/files", params=params, content=content,
                                 headers={"content-type": "application/octet-stream"})

    async def list(self, path: str) -> List[EntryInfo]:
        r = await self._s._c.request("GET", f"/v1/sandboxes/{self._s.id}/files/list", params={"path": path})
        return parse_entries(r.json())

    async def exists(self, path: str) -> bool:
        try:
            await self.read(path, format="bytes")
            return True
        except errors.NotFound:
            return False


class AsyncSandbox:
    def __init__(self, info: dict, client: Optional[AsyncClient] = None):
        self._c = client or default_async_client()
        self._info = SandboxInfo.from_json(info)
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.pty = __import__("grove.pty", fromlist=["AsyncPty"]).AsyncPty(self)  # terminals: grove/pty.py

    @classmethod
    async def create(cls, image: str = DEFAULT_IMAGE, *, cpu: Optional[float] = None, memory_mb: Optional[int] = None,
                     disk_mb: Optional[int] = None, pids: Optional[int] = None, timeout: Optional[float] = None,
                     env: Optional[Dict[str, str]] = None, labels: Optional[Dict[str, str]] = None,
                     network: Network = None, hostname: Optional[str] = None, workdir: Optional[str] = None,
                     client: Optional[AsyncClient] = None, idle_timeout: Optional[float] = None,
                     on_idle: Optional[str] = None, job: Optional[str] = None,
                     priority: Optional[int] = None) -> "AsyncSandbox":
        c = client or default_async_client()
        body = create_body(image=image, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, timeout=timeout,
                           env=env, labels=labels, network=network, hostname=hostname, workdir=workdir,
                           idle_timeout=idle_timeout, on_idle=on_idle, job=job, priority=priority)
        return cls((await c.request("POST", "/v1/sandboxes", json=body, headers=idempotency_headers())).json(), c)

    @classmethod
    async def connect(cls, sandbox_id: str, client: Optional[AsyncClient] = None) -> "AsyncSandbox":
        c = client or default_async_client()
        return cls((await c.request("GET", f"/v1/sandboxes/{_q(sandbox_id)}")).json(), c)

    @classmethod
    async def list(cls, labels: Optional[Dict[str, str]] = None, state: Optional[str] = None,
                   client: Optional[AsyncClient] = None) -> List["AsyncSandbox"]:
        c = client or default_async_client()
        out, token = [], None
        while True:
            page = (await c.request("GET", "/v1/sandboxes", params=list_params(labels, state, token))).json()
            out.extend(cls(s, c) for s in page["items"])
            token = page.get("next_page_token")
            if not token:
                return out

    @property
    def id(self) -> str:
        return self._info.id

    sandbox_id = id

    @property
    def info(self) -> SandboxInfo:
        return self._info

    @property
    def labels(self) -> Dict[str, str]:
        return self._info.labels

    async def refresh(self) -> SandboxInfo:
        self._info = SandboxInfo.from_json((await self._c.request("GET", f"/v1/sandboxes/{self.id}")).json())
        return self._info

    async def is_running(self) -> bool:
        try:
            return (await self.refresh()).state == "running"
        except errors.NotFound:
            return False

    async def kill(self) -> None:
        try:
            await self._c.request("DELETE", f"/v1/sandboxes/{self.id}", headers=idempotency_headers())
        except errors.NotFound:
            pass

    async def set_timeout(self, timeout: Optional[float]) -> None:
        ttl = None if timeout is None else max(1, int(timeout))
        r = await self._c.request("PUT", f"/v1/sandboxes/{self.id}/ttl", json={"ttl_secs": ttl})
        self._info = SandboxInfo.from_json(r.json())

    async def pause(self, to_store: bool = False) -> None:
        """Freezes the sandbox, or with `to_store` pauses it to the node's store (processes stop, memory freed).
        The next exec or file call resumes it."""
        q = "?to=store" if to_store else ""
        self._info = SandboxInfo.from_json((await self._c.request("POST", f"/v1/sandboxes/{self.id}/pause{q}")).json())

    async def resume(self) -> None:
        self._info = SandboxInfo.from_json((await self._c.request("POST", f"/v1/sandboxes/{self.id}/resume")).json())

    async def usage(self) -> dict:
        return (await self._c.request("GET", f"/v1/sandboxes/{self.id}/usage")).json()

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kill()

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r}, state={self._info.state!r})"

    async def exec(self, cmd: Union[str, Sequence[str]], *, timeout: Optional[float] = None,
                   env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None, stdin: Union[None, str, bytes] = None,
                   on_stdout: Optional[OutputCallback] = None, on_stderr: Optional[OutputCallback] = None) -> ExecResult:
        body = exec_body(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin)
        if on_stdout is None and on_stderr is None:
            r = await self._c.request("POST", f"/v1/sandboxes/{self.id}/exec", json=body, timeout=http_timeout(timeout))
            return parse_exec(r.json())
        out, err = bytearray(), bytearray()
        async with self._c.stream("POST", f"/v1/sandboxes/{self.id}/exec/stream", json=body,
                                  timeout=http_timeout(timeout)) as r:
            if not r.is_success:
                await r.aread()
                raise errors.from_response(r.status_code, r.json())
            p = SseParser()
            async for line in r.aiter_lines():
                got = p.feed(line)
                if got is None:
                    continue
                event, data = got
                if event in ("stdout", "stderr"):
                    chunk = base64.b64decode(data["data"])
                    (out if event == "stdout" else err).extend(chunk)
                    cb = on_stdout if event == "stdout" else on_stderr
                    if cb:
                        cb(chunk.decode("utf-8", "replace"))
                elif event == "exit":
                    return parse_exec(data, bytes(out), bytes(err))
                elif event == "error":
                    raise errors.from_response(500, data)
        raise errors.ServerError("the output stream ended without an exit status")

    async def snapshot(self, name: Optional[str] = None, stop: bool = False, durable: bool = False) -> "AsyncSnapshot":
        body = {"stop": stop}
        if name is not None:
            body["name"] = name
        if durable:
            body["durable"] = True
        return AsyncSnapshot((await self._c.request("POST", f"/v1/sandboxes/{self.id}/snapshot", json=body)).json(), self._c)


class AsyncSnapshot:
    def __init__(self, info: dict, client: Optional[AsyncClient] = None):
        self._c = client or default_async_client()
        self.info = info

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def durable(self) -> bool:
        """Whether the images are in the content store (as of when this object was fetched)."""
        return bool(self.info.get("durable", True))

    @classmethod
    async def get(cls, name: str, client: Optional[AsyncClient] = None) -> "AsyncSnapshot":
        c = client or default_async_client()
        return cls((await c.request("GET", f"/v1/snapshots/{_q(name)}")).json(), c)

    async def fork(self, n: int = 1, *, labels: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
                   hostname_prefix: Optional[str] = None) -> List[AsyncSandbox]:
        body: dict = {"count": n}
        if labels:
            body["labels"] = dict(labels)
        if timeout is not None:
            body["ttl_secs"] = max(1, int(timeout))
        if hostname_prefix:
            body["hostname_prefix"] = hostname_prefix
        r = await self._c.request("POST", f"/v1/snapshots/{_q(self.name)}/fork", json=body, headers=idempotency_headers())
        made, bad = batch_split(r.json())
        sbxs = [AsyncSandbox(s, self._c) for s in made]
        if bad:
            raise errors.ForkError(f"{len(bad)} of {n} branches failed: {bad[0].get('message')}", sandboxes=sbxs, errors=bad)
        return sbxs

    async def delete(self) -> None:
        await self._c.request("DELETE", f"/v1/snapshots/{_q(self.name)}")

    def __repr__(self) -> str:
        return f"AsyncSnapshot({self.name!r})"
