"""The synchronous API: `Sandbox`, its `commands` and `files`, and `Snapshot`."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union
from urllib.parse import quote

from . import errors
from ._api import (EntryInfo, ExecResult, Network, SandboxInfo, batch_split, create_body, exec_body, http_timeout,
                   list_params, parse_entries, parse_exec, sse_pairs)
from ._transport import Client, default_client, idempotency_headers, raise_for

DEFAULT_IMAGE = "debian12"
OutputCallback = Callable[[str], None]


def _q(s: str) -> str:
    return quote(s, safe="")


class Commands:
    """`sbx.commands.run(...)` (E2B's spelling), background processes, signals."""

    def __init__(self, sbx: "Sandbox"):
        self._s = sbx

    def run(self, cmd: Union[str, Sequence[str]], *, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
            cwd: Optional[str] = None, stdin: Union[None, str, bytes] = None, background: bool = False,
            on_stdout: Optional[OutputCallback] = None, on_stderr: Optional[OutputCallback] = None):
        if background:
            return self.start(cmd, env=env, cwd=cwd)
        return self._s.exec(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin, on_stdout=on_stdout, on_stderr=on_stderr)

    def start(self, cmd: Union[str, Sequence[str]], *, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> int:
        """Starts a background process; returns its pid."""
        body = exec_body(cmd, env=env, cwd=cwd, with_encoding=False)
        return self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/processes", json=body).json()["pid"]

    def list(self) -> List[dict]:
        return self._s._c.request("GET", f"/v1/sandboxes/{self._s.id}/processes").json()["items"]

    def kill(self, pid: int, signal: int = 9) -> None:
        self._s._c.request("POST", f"/v1/sandboxes/{self._s.id}/processes/{pid}/signal", json={"signal": signal})


class Files:
    """`sbx.files.read/write/list`, plus tar upload/download of directories."""

    def __init__(self, sbx: "Sandbox"):
        self._s = sbx

    def read(self, path: str, format: str = "text") -> Union[str, bytes]:
        data = self._s._c.request("GET", f"/v1/sandboxes/{self._s.id}/files", params={"path": path}).content
        return data if format == "bytes" else data.decode("utf-8", "replace")

    def write(self, path: str, data: Union[str, bytes], mode: Optional[int] = None) -> None:
        params = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        content = data.encode() if isinstance(data, str) else data
        self._s._c.request("PUT", f"/v1/sandboxes/{self._s.id}/files", params=params, content=content,
                           headers={"content-type": "application/octet-stream"})

    def list(self, path: str) -> List[EntryInfo]:
        return parse_entries(self._s._c.request("GET", f"/v1/sandboxes/{self._s.id}/files/list", params={"path": path}).json())

    def exists(self, path: str) -> bool:
        try:
            self.read(path, format="bytes")
            return True
        except errors.NotFound:
            return False

    def upload_tar(self, directory: str, tar_bytes: bytes) -> None:
        self._s._c.request("PUT", f"/v1/sandboxes/{self._s.id}/archive", params={"path": directory}, content=tar_bytes,
                           headers={"content-type": "application/x-tar"})

    def download_tar(self, directory: str) -> bytes:
        return self._s._c.request("GET", f"/v1/sandboxes/{self._s.id}/archive", params={"path": directory}).content


class Sandbox:
    """A Grove sandbox. `Sandbox.create(...)`, then `exec`, `files`, `snapshot`, `kill`; or use `with`."""

    def __init__(self, info: dict, client: Optional[Client] = None):
        self._c = client or default_client()
        self._info = SandboxInfo.from_json(info)
        self.commands = Commands(self)
        self.files = Files(self)
        self.pty = __import__("grove.pty", fromlist=["Pty"]).Pty(self)  # terminals: grove/pty.py

    # --- lifecycle -------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, image: str = DEFAULT_IMAGE, *, cpu: Optional[float] = None, memory_mb: Optional[int] = None,
               disk_mb: Optional[int] = None, pids: Optional[int] = None, timeout: Optional[float] = None,
               env: Optional[Dict[str, str]] = None, labels: Optional[Dict[str, str]] = None, network: Network = None,
               hostname: Optional[str] = None, workdir: Optional[str] = None, client: Optional[Client] = None,
               idle_timeout: Optional[float] = None, on_idle: Optional[str] = None, job: Optional[str] = None,
               priority: Optional[int] = None) -> "Sandbox":
        """`cpu` in cores (0.5 = half a core), `timeout` = seconds to live, `network` as in `_api.network_body`.
        `idle_timeout` = seconds without exec, file access or CPU use after which the node pauses the sandbox to
        its store (`on_idle="pause"`, the default; the next call resumes it) or destroys it (`"destroy"`).
        `job`: the training job (tenant) it counts against — quotas and fair queueing when the node is full;
        `priority` orders the job's own queued creates (higher first)."""
        c = client or default_client()
        body = create_body(image=image, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, timeout=timeout,
                           env=env, labels=labels, network=network, hostname=hostname, workdir=workdir,
                           idle_timeout=idle_timeout, on_idle=on_idle, job=job, priority=priority)
        return cls(c.request("POST", "/v1/sandboxes", json=body, headers=idempotency_headers()).json(), c)

    @classmethod
    def create_many(cls, count: int, image: str = DEFAULT_IMAGE, *, client: Optional[Client] = None, **kw) -> List["Sandbox"]:
        """One request for `count` sandboxes; raises ForkError (with the ones made) if any failed."""
        c = client or default_client()
        body = create_body(image=image, count=count, **kw)
        made, bad = batch_split(c.request("POST", "/v1/sandboxes", json=body, headers=idempotency_headers()).json())
        sbxs = [cls(s, c) for s in made]
        if bad:
            raise errors.ForkError(f"{len(bad)} of {count} creates failed: {bad[0].get('message')}", sandboxes=sbxs, errors=bad)
        return sbxs

    @classmethod
    def connect(cls, sandbox_id: str, client: Optional[Client] = None) -> "Sandbox":
        c = client or default_client()
        return cls(c.request("GET", f"/v1/sandboxes/{_q(sandbox_id)}").json(), c)

    @classmethod
    def list(cls, labels: Optional[Dict[str, str]] = None, state: Optional[str] = None,
             client: Optional[Client] = None) -> List["Sandbox"]:
        c = client or default_client()
        out, token = [], None
        while True:
            page = c.request("GET", "/v1/sandboxes", params=list_params(labels, state, token)).json()
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

    def refresh(self) -> SandboxInfo:
        self._info = SandboxInfo.from_json(self._c.request("GET", f"/v1/sandboxes/{self.id}").json())
        return self._info

    def is_running(self) -> bool:
        try:
            return self.refresh().state == "running"
        except errors.NotFound:
            return False

    def kill(self) -> None:
        """Destroys the sandbox (idempotent: killing a gone sandbox is fine)."""
        try:
            self._c.request("DELETE", f"/v1/sandboxes/{self.id}", headers=idempotency_headers())
        except errors.NotFound:
            pass

    def set_timeout(self, timeout: Optional[float]) -> None:
        ttl = None if timeout is None else max(1, int(timeout))
        self._info = SandboxInfo.from_json(self._c.request("PUT", f"/v1/sandboxes/{self.id}/ttl", json={"ttl_secs": ttl}).json())

    def pause(self, to_store: bool = False) -> None:
        """Freezes the sandbox, or with `to_store` pauses it to the node's store (processes stop, memory freed).
        The next exec or file call resumes it."""
        q = "?to=store" if to_store else ""
        self._info = SandboxInfo.from_json(self._c.request("POST", f"/v1/sandboxes/{self.id}/pause{q}").json())

    def resume(self) -> None:
        self._info = SandboxInfo.from_json(self._c.request("POST", f"/v1/sandboxes/{self.id}/resume").json())

    def usage(self) -> dict:
        return self._c.request("GET", f"/v1/sandboxes/{self.id}/usage").json()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, state={self._info.state!r})"

    # --- commands --------------------------------------------------------------------------------------------
    def exec(self, cmd: Union[str, Sequence[str]], *, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
             cwd: Optional[str] = None, stdin: Union[None, str, bytes] = None, on_stdout: Optional[OutputCallback] = None,
             on_stderr: Optional[OutputCallback] = None) -> ExecResult:
        """Runs `cmd` (a string runs under /bin/sh -c) to completion or `timeout` seconds. Never retried."""
        body = exec_body(cmd, timeout=timeout, env=env, cwd=cwd, stdin=stdin)
        if on_stdout is None and on_stderr is None:
            r = self._c.request("POST", f"/v1/sandboxes/{self.id}/exec", json=body, timeout=http_timeout(timeout))
            return parse_exec(r.json())
        return self._exec_stream(body, timeout, on_stdout, on_stderr)

    def _exec_stream(self, body, timeout, on_stdout, on_stderr) -> ExecResult:
        out, err = bytearray(), bytearray()
        with self._c.stream("POST", f"/v1/sandboxes/{self.id}/exec/stream", json=body, timeout=http_timeout(timeout)) as r:
            if not r.is_success:
                r.read()
                raise errors.from_response(r.status_code, r.json())
            for event, data in sse_pairs(r.iter_lines()):
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

    # --- snapshots -------------------------------------------------------------------------------------------
    def snapshot(self, name: Optional[str] = None, stop: bool = False, durable: bool = False) -> "Snapshot":
        """Freezes files, processes and memory into a snapshot; the sandbox keeps running unless `stop`.

        Returns as soon as the snapshot is forkable; its memory images reach the content store in the
        background (`Snapshot.durable`). `durable=True` returns only once they are stored."""
        body = {"stop": stop}
        if name is not None:
            body["name"] = name
        if durable:
            body["durable"] = True
        return Snapshot(self._c.request("POST", f"/v1/sandboxes/{self.id}/snapshot", json=body).json(), self._c)


class Snapshot:
    def __init__(self, info: dict, client: Optional[Client] = None):
        self._c = client or default_client()
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
    def get(cls, name: str, client: Optional[Client] = None) -> "Snapshot":
        c = client or default_client()
        return cls(c.request("GET", f"/v1/snapshots/{_q(name)}").json(), c)

    @classmethod
    def list(cls, client: Optional[Client] = None) -> List["Snapshot"]:
        c = client or default_client()
        return [cls(s, c) for s in c.request("GET", "/v1/snapshots").json()["items"]]

    def fork(self, n: int = 1, *, labels: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
             hostname_prefix: Optional[str] = None) -> List[Sandbox]:
        """`n` independent sandboxes restored from this snapshot. Raises ForkError (holding the ones made) if any failed."""
        body: dict = {"count": n}
        if labels:
            body["labels"] = dict(labels)
        if timeout is not None:
            body["ttl_secs"] = max(1, int(timeout))
        if hostname_prefix:
            body["hostname_prefix"] = hostname_prefix
        made, bad = batch_split(self._c.request("POST", f"/v1/snapshots/{_q(self.name)}/fork", json=body,
                                                headers=idempotency_headers()).json())
        sbxs = [Sandbox(s, self._c) for s in made]
        if bad:
            raise errors.ForkError(f"{len(bad)} of {n} branches failed: {bad[0].get('message')}", sandboxes=sbxs, errors=bad)
        return sbxs

    def delete(self) -> None:
        self._c.request("DELETE", f"/v1/snapshots/{_q(self.name)}")

    def export(self) -> bytes:
        return self._c.request("GET", f"/v1/snapshots/{_q(self.name)}/export", timeout=600).content

    def transfer(self, to: Client) -> "Transfer":
        """Copies this snapshot to the node behind `to`, moving only the content-store objects that node lacks:
        the source lists the snapshot's objects, the target names the ones it is missing, the source streams
        just those straight into the target's import."""
        objects = self._c.request("GET", f"/v1/snapshots/{_q(self.name)}/objects").json()["objects"]
        missing = to.request("POST", "/v1/snapshots/missing", json={"objects": objects}).json()["objects"]
        sent = [0]

        def body():
            for chunk in r.iter_bytes():
                sent[0] += len(chunk)
                yield chunk

        with self._c.stream("POST", f"/v1/snapshots/{_q(self.name)}/export", json={"missing": missing},
                            timeout=600) as r:
            if r.status_code != 200:
                r.read()
                raise_for(r)
            snap = Snapshot.import_(body(), client=to)
        return Transfer(snap, objects=len(objects), objects_sent=len(missing), bytes_sent=sent[0])

    @classmethod
    def pull(cls, name: str, source: str, *, client: Optional[Client] = None,
             source_api_key: Optional[str] = None) -> "Transfer":
        """The node behind `client` fetches snapshot `name` from the groved at `source` (`http://host:port`),
        asking it only for the objects it lacks; the bytes go node to node. The peer is called with
        `source_api_key`, else with the pulling node's own key."""
        c = client or default_client()
        body = {"source": source, "name": name}
        if source_api_key:
            body["source_api_key"] = source_api_key
        r = c.request("POST", "/v1/snapshots/pull", json=body, timeout=600).json()
        return Transfer(cls(r["snapshot"], c), objects=r["objects"], objects_sent=r["objects_sent"],
                        bytes_sent=r["bytes_received"])

    @classmethod
    def import_(cls, data: Union[bytes, Iterator[bytes]], client: Optional[Client] = None) -> "Snapshot":
        c = client or default_client()
        return cls(c.request("POST", "/v1/snapshots/import", content=data,
                             headers={"content-type": "application/octet-stream"}, timeout=600).json(), c)

    def __repr__(self) -> str:
        return f"Snapshot({self.name!r})"


@dataclass
class Transfer:
    """A snapshot copied to another node: the copy there, and what moved."""
    snapshot: Snapshot
    objects: int
    objects_sent: int
    bytes_sent: int
