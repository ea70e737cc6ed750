"""Sandbox and snapshot operations, written once (see `_core`); files and commands are in `_files` and
`_commands`.

The classes here are cores: `sandbox.py` and `async_sandbox.py` make the sync and asyncio classes of them.
Inside a core, an operation calls another through the core class (`SandboxCore.refresh(self)`, a generator),
never through `self.` (which is the shell's sync or async method)."""

from __future__ import annotations

import socket
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional, Sequence, Union

import httpx

from . import errors
from ._api import (Network, SandboxInfo, batch_split, create_body, exec_body, http_timeout, invalid,
                   list_params, parse_exec, positive_int, queue_timeout_ms, ttl_secs)
from ._core import Call, Op, op
from ._streams import OutputCallback, ProgressCallback, _body, _chunks, _Collect, _ExecEvents, _q
from ._transport import idempotency_headers

DEFAULT_IMAGE = "debian12"
#: Marks the processes of one exec, so a client that gives up on it can end them.
EXEC_MARK = "GROVE_EXEC_ID"
_KILL_MARKED = (f'for e in /proc/[0-9]*/environ; do if tr "\\0" "\\n" < "$e" 2>/dev/null | grep -qx "{EXEC_MARK}=$1"; '
                'then p=${e#/proc/}; kill -9 "${p%/environ}" 2>/dev/null; fi; done; true')


@dataclass
class Port:
    sandbox_port: int
    host_port: int


class SandboxCore:
    """A Grove sandbox: `create(...)`, then `exec`, `files`, `commands`, `snapshot`, `kill`."""

    _default_client: Callable[[], Any]
    _snapshot_cls: type
    _process_cls: type
    _commands_cls: type
    _files_cls: type

    def __init__(self, info: dict, client: Any = None):
        self._c = client or type(self)._default_client()
        self._info = SandboxInfo.from_json(info)
        self.commands = self._commands_cls(self)
        self.files = self._files_cls(self)

    # --- lifecycle ---------------------------------------------------------------------------------------
    @classmethod
    @op
    def create(cls, image: Optional[str] = None, *, snapshot: Any = None, cpu: Optional[float] = None,
               memory_mb: Optional[int] = None, disk_mb: Optional[int] = None, pids: Optional[int] = None,
               timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
               labels: Optional[Dict[str, str]] = None, network: Network = None, hostname: Optional[str] = None,
               workdir: Optional[str] = None, client: Any = None, idle_timeout: Optional[float] = None,
               on_idle: Optional[str] = None, job: Optional[str] = None, priority: Optional[int] = None,
               ports: Optional[Sequence[Any]] = None, queue_timeout: Optional[float] = None,
               userns: Optional[bool] = None) -> Op:
        """A new sandbox of `image` (default debian12), or a fork of `snapshot` (a Snapshot or its name).
        `cpu` in cores (0.5 = half a core); `timeout`: seconds to live (> 0; None: the node's default TTL);
        `network` as in `_api.network_body`; `ports`: published ports (`8080` or `(host, sandbox)`; see
        `get_host`). `idle_timeout`: seconds without exec, file access or CPU use after which the node pauses
        it to its store (`on_idle="pause"`, the default; the next call resumes it) or destroys it. `job`: the
        training job (tenant) it counts against; `priority` orders the job's own queued creates.
        `queue_timeout`: seconds this call may wait for room on a full node before `CapacityExceeded` (0: fail
        at once; None: the node's queue timeout, and the client's retries). `userns=True`: in a user namespace of
        its own, sandbox root unprivileged on the host (not snapshotable yet: snapshot/fork answer 409)."""
        c = client or cls._default_client()
        qt = queue_timeout
        if snapshot is not None:
            if image is not None:
                raise invalid("snapshot", "give an image or a snapshot, not both")
            body = create_body(snapshot=getattr(snapshot, "name", snapshot), timeout=timeout, labels=labels,
                               hostname=hostname, queue_timeout=qt)
            fixed = dict(cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, env=env, network=network,
                         workdir=workdir, idle_timeout=idle_timeout, on_idle=on_idle, job=job, priority=priority,
                         ports=ports, userns=userns)
            given = [k for k, v in fixed.items() if v is not None]
            if given:
                raise invalid(given[0], "is fixed by the snapshot; a fork takes only timeout, labels and hostname")
        else:
            body = create_body(image=image or DEFAULT_IMAGE, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb,
                               pids=pids, timeout=timeout, env=env, labels=labels, network=network,
                               hostname=hostname, workdir=workdir, idle_timeout=idle_timeout, on_idle=on_idle,
                               job=job, priority=priority, ports=ports, queue_timeout=qt, userns=userns)
        r = yield Call(c, "POST", "/v1/sandboxes", json=body, headers=idempotency_headers(), timeout=None,
                       queue_timeout=qt)
        return cls(r.json(), c)

    @classmethod
    @op
    def create_many(cls, count: int, image: Optional[str] = None, *, client: Any = None,
                    queue_timeout: Optional[float] = None, **kw: Any) -> Op:
        """One request for `count` sandboxes; raises ForkError (with the ones made) if any failed."""
        c = client or cls._default_client()
        body = create_body(image=image or DEFAULT_IMAGE, count=count, queue_timeout=queue_timeout, **kw)
        r = yield Call(c, "POST", "/v1/sandboxes", json=body, headers=idempotency_headers(), timeout=None,
                       queue_timeout=queue_timeout)
        made, bad = batch_split(r.json())
        sbxs = [cls(s, c) for s in made]
        if bad:
            raise errors.ForkError(f"{len(bad)} of {count} creates failed: {bad[0].get('message')}",
                                   sandboxes=sbxs, errors=bad)
        return sbxs

    @classmethod
    @op
    def connect(cls, sandbox_id: str, client: Any = None) -> Op:
        c = client or cls._default_client()
        return cls((yield Call(c, "GET", f"/v1/sandboxes/{_q(sandbox_id)}")).json(), c)

    @classmethod
    @op
    def list(cls, labels: Optional[Dict[str, str]] = None, state: Optional[str] = None, client: Any = None) -> Op:
        c = client or cls._default_client()
        out, token = [], None
        while True:
            page = (yield Call(c, "GET", "/v1/sandboxes", params=list_params(labels, state, token))).json()
            out.extend(cls(s, c) for s in page["items"])
            token = page.get("next_page_token")
            if not token:
                return out

    @classmethod
    @op
    def delete_many(cls, ids: Optional[Sequence[str]] = None, *, labels: Optional[Dict[str, str]] = None,
                    job: Optional[str] = None, client: Any = None) -> Op:
        """Destroys, in one request, the sandboxes named by `ids` and every one carrying all of `labels` (of
        `job`, when given); returns the ids destroyed."""
        c = client or cls._default_client()
        if not ids and not labels and job is None:
            raise invalid("ids", "give ids, labels or job (deleting everything is not a batch delete)")
        body: Dict[str, Any] = {"ids": list(ids or [])}
        if labels:
            body["labels"] = dict(labels)
        if job is not None:
            body["job"] = job
        r = yield Call(c, "POST", "/v1/sandboxes/delete", json=body, timeout=None, idempotent=True)
        return [d["id"] for d in r.json()["results"] if d.get("deleted")]

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

    @property
    def ports(self) -> List[Port]:
        return [Port(p["sandbox_port"], p["host_port"]) for p in self._info.raw.get("ports") or []]

    def get_host(self, port: int) -> str:
        """`host:port` where other machines reach the sandbox's published `port`: the node's host as this
        client addresses it (its URL), or over the local socket this machine's name. (Published ports are
        mapped for traffic from outside the node, not for the node's own loopback.)"""
        for p in self.ports:
            if p.sandbox_port == port:
                base = self._c.options.base_url
                host = httpx.URL(base).host if base else socket.gethostname()
                return f"{host}:{p.host_port}"
        raise invalid("port", f"port {port} is not published (create with ports=[{port}])")

    @op
    def refresh(self) -> Op:
        self._info = SandboxInfo.from_json((yield Call(self._c, "GET", f"/v1/sandboxes/{self.id}")).json())
        return self._info

    @op
    def is_running(self) -> Op:
        try:
            return (yield from SandboxCore.refresh(self)).state == "running"
        except errors.NotFound:
            return False

    @op
    def kill(self) -> Op:
        """Destroys the sandbox (idempotent: killing a gone sandbox is fine)."""
        try:
            yield Call(self._c, "DELETE", f"/v1/sandboxes/{self.id}", headers=idempotency_headers(), timeout=None)
        except errors.NotFound:
            pass

    @op
    def set_timeout(self, timeout: Optional[float]) -> Op:
        """Seconds to live from now (> 0), or None or 0: no expiry."""
        ttl = ttl_secs("timeout", timeout) or None
        r = yield Call(self._c, "PUT", f"/v1/sandboxes/{self.id}/ttl", json={"ttl_secs": ttl})
        self._info = SandboxInfo.from_json(r.json())

    @op
    def pause(self, to_store: bool = False) -> Op:
        """Freezes the sandbox, or with `to_store` pauses it to the node's store (processes stop, memory
        freed). The next exec or file call resumes it."""
        q = "?to=store" if to_store else ""
        r = yield Call(self._c, "POST", f"/v1/sandboxes/{self.id}/pause{q}", timeout=None)
        self._info = SandboxInfo.from_json(r.json())

    @op
    def resume(self) -> Op:
        r = yield Call(self._c, "POST", f"/v1/sandboxes/{self.id}/resume", timeout=None)
        self._info = SandboxInfo.from_json(r.json())

    @op
    def usage(self) -> Op:
        return (yield Call(self._c, "GET", f"/v1/sandboxes/{self.id}/usage")).json()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, state={self._info.state!r})"

    # --- commands ----------------------------------------------------------------------------------------
    @op
    def exec(self, cmd: Union[str, Sequence[str]], *, timeout: Optional[float] = None,
             env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None, stdin: Union[None, str, bytes] = None,
             on_stdout: Optional[OutputCallback] = None, on_stderr: Optional[OutputCallback] = None,
             user: Optional[str] = None) -> Op:
        """Runs `cmd` (a string runs under /bin/sh -c) to completion, however long it takes, or until `timeout`
        seconds (None or 0: no limit), when it is killed in the sandbox. `user`: run as this user of the
        sandbox, a name from its /etc/passwd or `uid[:gid]`. Never run twice: it carries an
        Idempotency-Key, so should the connection break, the retry gets the first run's answer. A streamed one
        (`on_stdout`/`on_stderr`) is not retried: `ConnectionLost`, and groved ends the command with it."""
        mark = uuid.uuid4().hex
        body = exec_body(cmd, timeout=timeout, env={**(env or {}), EXEC_MARK: mark}, cwd=cwd, stdin=stdin, user=user)
        wait = http_timeout(timeout)
        # Should the caller give up (its deadline, a cancelled task, Ctrl-C), its processes are killed.
        end = Call(self._c, "POST", f"/v1/sandboxes/{self.id}/exec", timeout=30,
                   json=exec_body(["/bin/sh", "-c", _KILL_MARKED, "sh", mark], timeout=20))
        if on_stdout is None and on_stderr is None:
            # Keyed: should the connection break, the retry gets the first run's answer (groved runs it once).
            r = yield Call(self._c, "POST", f"/v1/sandboxes/{self.id}/exec", json=body, timeout=wait, on_abandon=end,
                           headers=idempotency_headers())
            return parse_exec(r.json())
        ev = _ExecEvents(on_stdout, on_stderr)
        yield Call(self._c, "POST", f"/v1/sandboxes/{self.id}/exec/stream", json=body, timeout=wait, sink=ev,
                   on_abandon=end)
        if ev.error is not None:
            raise errors.from_response(500, ev.error)
        if ev.result is None:
            raise errors.ConnectionLost("the output stream ended without an exit status", code="connection_lost")
        return ev.result

    # --- snapshots ---------------------------------------------------------------------------------------
    @op
    def snapshot(self, name: Optional[str] = None, stop: bool = False, durable: bool = False, *,
                 ttl: Optional[float] = None) -> Op:
        """Freezes files, processes and memory into a snapshot; the sandbox keeps running unless `stop`.

        Returns as soon as the snapshot is forkable; its memory images reach the content store in the
        background (`Snapshot.durable`). `durable=True` returns only once they are stored. `ttl`: seconds
        after which groved deletes it, once no sandbox forked from it lives and no snapshot below it is kept
        (None or 0: kept until deleted) -- what a tree search wants for its inner nodes."""
        body: Dict[str, Any] = {"stop": stop}
        if name is not None:
            body["name"] = name
        t = ttl_secs("ttl", ttl)
        if t:
            body["ttl_secs"] = t
        if durable:
            body["durable"] = True
        r = yield Call(self._c, "POST", f"/v1/sandboxes/{self.id}/snapshot", json=body, timeout=None,
                       headers=idempotency_headers())
        return self._snapshot_cls(r.json(), self._c)


class SnapshotCore:
    """A snapshot: fork it into sandboxes, export it, move it to another node, delete it."""

    _default_client: Callable[[], Any]
    _sandbox_cls: type

    def __init__(self, info: dict, client: Any = None):
        self._c = client or type(self)._default_client()
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

    @property
    def parent(self) -> Optional[str]:
        """The snapshot its source sandbox was forked from (None: made from an image)."""
        return self.info.get("parent")

    @property
    def expires_at_ms(self) -> Optional[int]:
        return self.info.get("expires_at_ms")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @classmethod
    @op
    def get(cls, name: str, client: Any = None) -> Op:
        c = client or cls._default_client()
        return cls((yield Call(c, "GET", f"/v1/snapshots/{_q(name)}")).json(), c)

    @classmethod
    @op
    def list(cls, client: Any = None) -> Op:
        c = client or cls._default_client()
        return [cls(s, c) for s in (yield Call(c, "GET", "/v1/snapshots")).json()["items"]]

    @op
    def fork(self, n: int = 1, *, labels: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
             hostname_prefix: Optional[str] = None, queue_timeout: Optional[float] = None) -> Op:
        """`n` independent sandboxes restored from this snapshot. Raises ForkError (holding the ones made) if
        any failed. `timeout`: their seconds to live (0: no expiry; None: the source sandbox's TTL)."""
        body: Dict[str, Any] = {"count": positive_int("n", n)}
        if labels:
            body["labels"] = dict(labels)
        ttl = ttl_secs("timeout", timeout)  # 0: no expiry; None: the source's TTL
        if ttl is not None:
            body["ttl_secs"] = ttl
        if hostname_prefix:
            body["hostname_prefix"] = hostname_prefix
        qt = queue_timeout_ms(queue_timeout)
        if qt is not None:
            body["queue_timeout_ms"] = qt
        r = yield Call(self._c, "POST", f"/v1/snapshots/{_q(self.name)}/fork", json=body,
                       headers=idempotency_headers(), timeout=None, queue_timeout=queue_timeout)
        made, bad = batch_split(r.json())
        sbxs = [self._sandbox_cls(s, self._c) for s in made]
        if bad:
            raise errors.ForkError(f"{len(bad)} of {n} branches failed: {bad[0].get('message')}", sandboxes=sbxs,
                                   errors=bad)
        return sbxs

    @op
    def delete(self, *, descendants: bool = False) -> Op:
        """Deletes the snapshot, and with `descendants` every snapshot below it (taken from its forks, and so
        on); returns the names deleted."""
        params = {"descendants": "true"} if descendants else None
        r = yield Call(self._c, "DELETE", f"/v1/snapshots/{_q(self.name)}", params=params, timeout=None)
        return r.json()["deleted"] if r.content else [self.name]

    @classmethod
    @op
    def gc(cls, labels: Optional[Dict[str, str]] = None, client: Any = None) -> Op:
        """Deletes expired snapshots, and with `labels` every one carrying them, that nothing needs any more
        (no live fork, no kept snapshot below); the node's store then frees their bytes. Returns the names."""
        c = client or cls._default_client()
        r = yield Call(c, "POST", "/v1/snapshots/gc", json={"labels": dict(labels or {})}, timeout=None,
                       idempotent=True)
        return r.json()["deleted"]

    @op
    def export(self, *, on_progress: Optional[ProgressCallback] = None) -> Op:
        """The snapshot as one self-contained stream of bytes (for `import_`)."""
        sink = _Collect(on_progress=on_progress)
        yield Call(self._c, "GET", f"/v1/snapshots/{_q(self.name)}/export", timeout=None, sink=sink)
        return bytes(sink.buf)

    @classmethod
    @op
    def import_(cls, data: Union[bytes, BinaryIO, Iterable[bytes]], client: Any = None, *,
                on_progress: Optional[ProgressCallback] = None) -> Op:
        c = client or cls._default_client()
        r = yield Call(c, "POST", "/v1/snapshots/import", content=_body(data, on_progress),
                       headers={"content-type": "application/octet-stream"}, timeout=None)
        return cls(r.json(), c)

    @op
    def transfer(self, to: Any) -> Op:
        """Copies this snapshot to the node behind client `to`, moving only the content-store objects that node
        lacks: the source lists the snapshot's objects, the target names the ones it is missing, the delta is
        spooled to a temporary file (bounded memory) and streamed into the target's import."""
        objects = (yield Call(self._c, "GET", f"/v1/snapshots/{_q(self.name)}/objects")).json()["objects"]
        missing = (yield Call(to, "POST", "/v1/snapshots/missing", json={"objects": objects})).json()["objects"]
        with tempfile.TemporaryFile() as spool:
            sink = _Collect(spool)
            yield Call(self._c, "POST", f"/v1/snapshots/{_q(self.name)}/export", json={"missing": missing},
                       timeout=None, sink=sink, idempotent=True)
            spool.seek(0)
            r = yield Call(to, "POST", "/v1/snapshots/import", content=_chunks(spool, sink.done, None),
                           headers={"content-type": "application/octet-stream"}, timeout=None)
        return Transfer(type(self)(r.json(), to), objects=len(objects), objects_sent=len(missing),
                        bytes_sent=sink.done)

    @classmethod
    @op
    def pull(cls, name: str, source: str, *, client: Any = None, source_api_key: Optional[str] = None) -> Op:
        """The node behind `client` fetches snapshot `name` from the groved at `source` (`http://host:port`),
        asking it only for the objects it lacks; the bytes go node to node. The peer is called with
        `source_api_key`, else with the pulling node's own key."""
        c = client or cls._default_client()
        body = {"source": source, "name": name}
        if source_api_key:
            body["source_api_key"] = source_api_key
        r = (yield Call(c, "POST", "/v1/snapshots/pull", json=body, timeout=None)).json()
        return Transfer(cls(r["snapshot"], c), objects=r["objects"], objects_sent=r["objects_sent"],
                        bytes_sent=r["bytes_received"])


@dataclass
class Transfer:
    """A snapshot copied to another node: the copy there, and what moved."""
    snapshot: Any
    objects: int
    objects_sent: int
    bytes_sent: int
