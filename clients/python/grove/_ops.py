"""Every sandbox, command, file, process and snapshot operation, written once (see `_core`).

The classes here are cores: `sandbox.py` and `async_sandbox.py` make the sync and asyncio classes of them.
Inside a core, an operation calls another through the core class (`FilesCore.list(self, ...)`, a generator),
never through `self.` (which is the shell's sync or async method)."""

from __future__ import annotations

import base64
import io
import os
import posixpath
import shutil
import socket
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Union
from urllib.parse import quote

import httpx

from . import errors
from ._api import (EntryInfo, ExecResult, Network, SandboxInfo, SseParser, batch_split, create_body, exec_body,
                   http_timeout, invalid, lifetime_secs, list_params, parse_entries, parse_exec, positive_int,
                   positive_seconds)
from ._core import Call, Op, Sleep, op
from ._transport import idempotency_headers

DEFAULT_IMAGE = "debian12"
OutputCallback = Callable[[str], None]
#: `on_progress(done_bytes, total_bytes_or_None)` during an upload or download.
ProgressCallback = Callable[[int, Optional[int]], None]
#: Bytes per piece of a streamed upload.
CHUNK = 1 << 20
#: A file at most this big is sent as one buffer.
SMALL = 256 << 10
LOG_DIR = "/run/grove/logs"
#: Marks the processes of one exec, so a client that gives up on it can end them.
EXEC_MARK = "GROVE_EXEC_ID"
_KILL_MARKED = (f'for e in /proc/[0-9]*/environ; do if tr "\\0" "\\n" < "$e" 2>/dev/null | grep -qx "{EXEC_MARK}=$1"; '
                'then p=${e#/proc/}; kill -9 "${p%/environ}" 2>/dev/null; fi; done; true')


def _q(s: str) -> str:
    return quote(s, safe="")


def _abs(field: str, path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise invalid(field, f"{path!r} is not an absolute path in the sandbox")
    return path


# --- request bodies that stream ------------------------------------------------------------------------------
def _chunks(src: Union[bytes, BinaryIO, Iterable[bytes]], total: Optional[int],
            on_progress: Optional[ProgressCallback]) -> Iterator[bytes]:
    done = 0
    if isinstance(src, (bytes, bytearray, memoryview)):
        view = memoryview(src)
        it: Iterable[bytes] = (view[i:i + CHUNK] for i in range(0, len(view), CHUNK))
    elif hasattr(src, "read"):
        it = iter(lambda: src.read(CHUNK), b"")  # type: ignore[union-attr]
    else:
        it = src  # type: ignore[assignment]
    for c in it:
        done += len(c)
        yield bytes(c)
        if on_progress:
            on_progress(done, total)


def _body(data: Any, on_progress: Optional[ProgressCallback]) -> Any:
    """What to send: small buffers whole, anything else streamed in pieces (with progress)."""
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) <= SMALL and on_progress is None:
            return bytes(data)
        return _chunks(data, len(data), on_progress)
    total = None
    if hasattr(data, "fileno"):
        try:
            total = os.fstat(data.fileno()).st_size - data.tell()
        except (OSError, ValueError, io.UnsupportedOperation):
            total = None
    return _chunks(data, total, on_progress)


class _Collect:
    """A response sink that keeps the bytes (or writes them to a file), reporting progress."""

    def __init__(self, out: Optional[BinaryIO] = None, on_progress: Optional[ProgressCallback] = None):
        self.buf = bytearray()
        self.out = out
        self.done = 0
        self.on_progress = on_progress

    def __call__(self, chunk: bytes) -> None:
        self.done += len(chunk)
        if self.out is not None:
            self.out.write(chunk)
        else:
            self.buf.extend(chunk)
        if self.on_progress:
            self.on_progress(self.done, None)


class _ExecEvents:
    """The SSE stream of a streamed exec, parsed as it arrives."""

    def __init__(self, on_stdout: Optional[OutputCallback], on_stderr: Optional[OutputCallback]):
        self.p = SseParser()
        self.pending = b""
        self.out, self.err = bytearray(), bytearray()
        self.on_stdout, self.on_stderr = on_stdout, on_stderr
        self.result: Optional[ExecResult] = None
        self.error: Optional[dict] = None

    def __call__(self, chunk: bytes) -> bool:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for raw in lines:
            got = self.p.feed(raw.decode("utf-8").rstrip("\r"))
            if got is None:
                continue
            event, data = got
            if event in ("stdout", "stderr"):
                piece = base64.b64decode(data["data"])
                (self.out if event == "stdout" else self.err).extend(piece)
                cb = self.on_stdout if event == "stdout" else self.on_stderr
                if cb:
                    cb(piece.decode("utf-8", "replace"))
            elif event == "exit":
                self.result = parse_exec(data, bytes(self.out), bytes(self.err))
                return True
            elif event == "error":
                self.error = data
                return True
        return False


# --- results -------------------------------------------------------------------------------------------------
@dataclass
class FsEvent:
    """A change `files.watch` saw: `type` is "create", "remove" or "modify"."""
    type: str
    path: str


@dataclass
class Port:
    sandbox_port: int
    host_port: int


# --- cores ---------------------------------------------------------------------------------------------------
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
        d = (yield Call(self._s._c, "POST", f"/v1/sandboxes/{self._s.id}/processes", json=body)).json()
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


class FilesCore:
    """`sbx.files`: read/write (streamed, with progress), upload/download of files and directories, list,
    stat, exists, make_dir, remove, rename, watch."""

    def __init__(self, sbx: Any):
        self._s = sbx

    def _url(self, what: str = "files") -> str:
        return f"/v1/sandboxes/{self._s.id}/{what}"

    @op
    def read(self, path: str, format: str = "text", *, on_progress: Optional[ProgressCallback] = None) -> Op:
        """The file's bytes (`format="bytes"`) or text, streamed in."""
        sink = _Collect(on_progress=on_progress)
        yield Call(self._s._c, "GET", self._url(), params={"path": path}, sink=sink, timeout=None)
        data = bytes(sink.buf)
        return data if format == "bytes" else data.decode("utf-8", "replace")

    @op
    def write(self, path: str, data: Union[str, bytes, BinaryIO, Iterable[bytes]], mode: Optional[int] = None, *,
              on_progress: Optional[ProgressCallback] = None) -> Op:
        """Writes `data` (text, bytes, an open binary file or an iterable of chunks) to `path`, streamed."""
        params = {"path": path}
        if mode is not None:
            params["mode"] = format(mode, "o")
        yield Call(self._s._c, "PUT", self._url(), params=params, content=_body(data, on_progress),
                   headers={"content-type": "application/octet-stream"}, timeout=None)

    @op
    def upload(self, local_path: str, path: str, mode: Optional[int] = None, *,
               on_progress: Optional[ProgressCallback] = None) -> Op:
        """Copies a local file into the sandbox, streamed."""
        with open(local_path, "rb") as f:
            yield from FilesCore.write(self, path, f, mode, on_progress=on_progress)

    @op
    def download(self, path: str, local_path: str, *, on_progress: Optional[ProgressCallback] = None) -> Op:
        """Copies a file out of the sandbox to `local_path`, streamed (nothing is left there if it fails)."""
        tmp = f"{local_path}.grove-part"
        try:
            with open(tmp, "wb") as f:
                yield Call(self._s._c, "GET", self._url(), params={"path": path}, timeout=None,
                           sink=_Collect(f, on_progress))
            os.replace(tmp, local_path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @op
    def list(self, path: str) -> Op:
        r = yield Call(self._s._c, "GET", self._url("files/list"), params={"path": path})
        return parse_entries(r.json())

    @op
    def stat(self, path: str) -> Op:
        """The entry of `path` (type, size, mode); NotFound if there is none."""
        _abs("path", path)
        norm = posixpath.normpath(path)
        if norm == "/":
            return EntryInfo("/", "/", "dir", 0, 0o755)
        parent, name = posixpath.split(norm)
        for e in (yield from FilesCore.list(self, parent)):
            if e.name == name:
                return e
        raise errors.NotFound(f"{path} does not exist in {self._s.id}", code="not_found", field="path")

    @op
    def exists(self, path: str) -> Op:
        try:
            yield from FilesCore.stat(self, path)
            return True
        except errors.NotFound:
            return False

    def _run(self, argv: List[str], what: str) -> Op:
        r = yield from SandboxCore.exec(self._s, argv)
        if r.exit_code not in (0, 3):
            raise errors.GroveError(f"{what} failed: {r.stderr.strip() or f'exit {r.exit_code}'}",
                                    code="file_operation_failed", field="path")
        return r.exit_code

    @op
    def make_dir(self, path: str) -> Op:
        """Creates the directory and its parents; False if it was already there."""
        _abs("path", path)
        code = yield from self._run(["/bin/sh", "-c", 'if [ -d "$1" ]; then exit 3; fi; exec mkdir -p -- "$1"',
                                     "sh", path], f"make_dir {path}")
        return code == 0

    @op
    def remove(self, path: str) -> Op:
        """Removes a file or a whole directory tree (a missing path is fine)."""
        _abs("path", path)
        if posixpath.normpath(path) == "/":
            raise invalid("path", "refusing to remove /")
        yield from self._run(["rm", "-rf", "--", path], f"remove {path}")

    @op
    def rename(self, old_path: str, new_path: str) -> Op:
        """Moves `old_path` to `new_path` (replacing a file there)."""
        _abs("old_path", old_path)
        _abs("new_path", new_path)
        yield from FilesCore.stat(self, old_path)
        yield from self._run(["mv", "-T", "--", old_path, new_path], f"rename {old_path} to {new_path}")

    @op
    def upload_tar(self, directory: str, tar: Union[bytes, BinaryIO, Iterable[bytes]], *,
                   on_progress: Optional[ProgressCallback] = None) -> Op:
        """Unpacks a tar (bytes, an open file or chunks, streamed) under `directory`."""
        yield Call(self._s._c, "PUT", self._url("archive"), params={"path": directory},
                   content=_body(tar, on_progress), headers={"content-type": "application/x-tar"}, timeout=None)

    @op
    def download_tar(self, directory: str, *, on_progress: Optional[ProgressCallback] = None) -> Op:
        """The directory as tar bytes."""
        sink = _Collect(on_progress=on_progress)
        yield Call(self._s._c, "GET", self._url("archive"), params={"path": directory}, sink=sink, timeout=None)
        return bytes(sink.buf)

    @op
    def upload_dir(self, local_dir: str, path: str, *, on_progress: Optional[ProgressCallback] = None) -> Op:
        """Copies a local directory's contents under `path` (made if missing), as one streamed tar."""
        if not os.path.isdir(local_dir):
            raise invalid("local_dir", f"{local_dir!r} is not a directory")
        with tempfile.TemporaryFile() as spool:
            with tarfile.open(fileobj=spool, mode="w") as t:
                for name in sorted(os.listdir(local_dir)):
                    t.add(os.path.join(local_dir, name), arcname=name)
            spool.seek(0)
            yield from FilesCore.upload_tar(self, path, spool, on_progress=on_progress)

    @op
    def download_dir(self, path: str, local_dir: str, *, on_progress: Optional[ProgressCallback] = None) -> Op:
        """Copies the directory's contents to `local_dir` (made if missing). Members that would land outside
        it (absolute paths, `..`, links, devices) are refused: the sandbox is not trusted."""
        with tempfile.TemporaryFile() as spool:
            yield Call(self._s._c, "GET", self._url("archive"), params={"path": path}, timeout=None,
                       sink=_Collect(spool, on_progress))
            spool.seek(0)
            os.makedirs(local_dir, exist_ok=True)
            with tarfile.open(fileobj=spool, mode="r") as t:
                _safe_extract(t, local_dir)

    @op
    def watch(self, path: str, *, timeout: Optional[float] = None, interval: float = 0.5,
              on_event: Optional[Callable[[FsEvent], Optional[bool]]] = None) -> Op:
        """Changes in directory `path` (entries created, removed, or changed in size or mode), by polling every
        `interval` s. Without `on_event`: returns the first batch of changes ([] once `timeout` passes). With
        it: calls it for each change until it returns False or `timeout` passes; returns them all."""
        limit = positive_seconds("timeout", timeout)
        interval = positive_seconds("interval", interval) or 0.5
        deadline = None if limit is None else time.monotonic() + limit

        def snap(entries: List[EntryInfo]) -> Dict[str, tuple]:
            return {e.path: (e.type, e.size, e.mode) for e in entries}

        before = snap((yield from FilesCore.list(self, path)))
        seen: List[FsEvent] = []
        while deadline is None or time.monotonic() < deadline:
            yield Sleep(interval)
            now = snap((yield from FilesCore.list(self, path)))
            batch = [FsEvent("create", p) for p in now if p not in before]
            batch += [FsEvent("remove", p) for p in before if p not in now]
            batch += [FsEvent("modify", p) for p in now if p in before and now[p] != before[p]]
            before = now
            if not batch:
                continue
            if on_event is None:
                return batch
            seen += batch
            if any(on_event(e) is False for e in batch):
                return seen
        return seen


def _safe_extract(t: tarfile.TarFile, dest: str) -> None:
    root = os.path.realpath(dest)
    for m in t:
        target = os.path.realpath(os.path.join(root, m.name))
        if not (target == root or target.startswith(root + os.sep)) or not (m.isfile() or m.isdir()):
            continue
        if m.isdir():
            os.makedirs(target, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        src = t.extractfile(m)
        assert src is not None
        with src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, CHUNK)
        os.chmod(target, m.mode & 0o755)


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
               ports: Optional[Sequence[Any]] = None, queue_timeout: Optional[float] = None) -> Op:
        """A new sandbox of `image` (default debian12), or a fork of `snapshot` (a Snapshot or its name).
        `cpu` in cores (0.5 = half a core); `timeout`: seconds to live (> 0; None: the node's default TTL);
        `network` as in `_api.network_body`; `ports`: published ports (`8080` or `(host, sandbox)`; see
        `get_host`). `idle_timeout`: seconds without exec, file access or CPU use after which the node pauses
        it to its store (`on_idle="pause"`, the default; the next call resumes it) or destroys it. `job`: the
        training job (tenant) it counts against; `priority` orders the job's own queued creates.
        `queue_timeout`: seconds this call may wait for room on a full node before `CapacityExceeded`."""
        c = client or cls._default_client()
        qt = positive_seconds("queue_timeout", queue_timeout)
        if snapshot is not None:
            if image is not None:
                raise invalid("snapshot", "give an image or a snapshot, not both")
            body = create_body(snapshot=getattr(snapshot, "name", snapshot), timeout=timeout, labels=labels,
                               hostname=hostname)
            fixed = dict(cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, pids=pids, env=env, network=network,
                         workdir=workdir, idle_timeout=idle_timeout, on_idle=on_idle, job=job, priority=priority,
                         ports=ports)
            given = [k for k, v in fixed.items() if v is not None]
            if given:
                raise invalid(given[0], "is fixed by the snapshot; a fork takes only timeout, labels and hostname")
        else:
            body = create_body(image=image or DEFAULT_IMAGE, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb,
                               pids=pids, timeout=timeout, env=env, labels=labels, network=network,
                               hostname=hostname, workdir=workdir, idle_timeout=idle_timeout, on_idle=on_idle,
                               job=job, priority=priority, ports=ports)
        r = yield Call(c, "POST", "/v1/sandboxes", json=body, headers=idempotency_headers(), timeout=None,
                       queue_timeout=qt)
        return cls(r.json(), c)

    @classmethod
    @op
    def create_many(cls, count: int, image: Optional[str] = None, *, client: Any = None,
                    queue_timeout: Optional[float] = None, **kw: Any) -> Op:
        """One request for `count` sandboxes; raises ForkError (with the ones made) if any failed."""
        c = client or cls._default_client()
        body = create_body(image=image or DEFAULT_IMAGE, count=count, **kw)
        r = yield Call(c, "POST", "/v1/sandboxes", json=body, headers=idempotency_headers(), timeout=None,
                       queue_timeout=positive_seconds("queue_timeout", queue_timeout))
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
                    client: Any = None) -> Op:
        """Destroys the sandboxes named by `ids` and every one carrying all of `labels`, in one request;
        returns the ids destroyed. (A job's sandboxes: `labels` the job put on them.)"""
        c = client or cls._default_client()
        if not ids and not labels:
            raise invalid("ids", "give ids or labels (deleting everything is not a batch delete)")
        body: Dict[str, Any] = {"ids": list(ids or [])}
        if labels:
            body["labels"] = dict(labels)
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
        """Seconds to live from now (> 0), or None: no expiry."""
        ttl = lifetime_secs("timeout", timeout)
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
             on_stdout: Optional[OutputCallback] = None, on_stderr: Optional[OutputCallback] = None) -> Op:
        """Runs `cmd` (a string runs under /bin/sh -c) to completion, however long it takes, or until `timeout`
        seconds (None or 0: no limit), when it is killed in the sandbox. Never sent twice: a connection lost
        midway raises `ConnectionLost`, and the command is ended by groved when its client is gone."""
        mark = uuid.uuid4().hex
        body = exec_body(cmd, timeout=timeout, env={**(env or {}), EXEC_MARK: mark}, cwd=cwd, stdin=stdin)
        wait = http_timeout(timeout)
        # Should the caller give up (its deadline, a cancelled task, Ctrl-C), its processes are killed.
        end = Call(self._c, "POST", f"/v1/sandboxes/{self.id}/exec", timeout=30,
                   json=exec_body(["/bin/sh", "-c", _KILL_MARKED, "sh", mark], timeout=20))
        if on_stdout is None and on_stderr is None:
            r = yield Call(self._c, "POST", f"/v1/sandboxes/{self.id}/exec", json=body, timeout=wait, on_abandon=end)
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
    def snapshot(self, name: Optional[str] = None, stop: bool = False, durable: bool = False) -> Op:
        """Freezes files, processes and memory into a snapshot; the sandbox keeps running unless `stop`.

        Returns as soon as the snapshot is forkable; its memory images reach the content store in the
        background (`Snapshot.durable`). `durable=True` returns only once they are stored."""
        body: Dict[str, Any] = {"stop": stop}
        if name is not None:
            body["name"] = name
        if durable:
            body["durable"] = True
        r = yield Call(self._c, "POST", f"/v1/sandboxes/{self.id}/snapshot", json=body, timeout=None)
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
        any failed. `timeout`: their seconds to live (> 0)."""
        body: Dict[str, Any] = {"count": positive_int("n", n)}
        if labels:
            body["labels"] = dict(labels)
        ttl = lifetime_secs("timeout", timeout)
        if ttl is not None:
            body["ttl_secs"] = ttl
        if hostname_prefix:
            body["hostname_prefix"] = hostname_prefix
        r = yield Call(self._c, "POST", f"/v1/snapshots/{_q(self.name)}/fork", json=body,
                       headers=idempotency_headers(), timeout=None,
                       queue_timeout=positive_seconds("queue_timeout", queue_timeout))
        made, bad = batch_split(r.json())
        sbxs = [self._sandbox_cls(s, self._c) for s in made]
        if bad:
            raise errors.ForkError(f"{len(bad)} of {n} branches failed: {bad[0].get('message')}", sandboxes=sbxs,
                                   errors=bad)
        return sbxs

    @op
    def delete(self) -> Op:
        yield Call(self._c, "DELETE", f"/v1/snapshots/{_q(self.name)}", timeout=None)

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
