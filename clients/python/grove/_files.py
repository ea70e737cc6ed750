"""Files of a sandbox: streamed reads and writes, directories both ways, stat, rename, watch; written once for
both clients (see `_core`)."""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional, Union

from . import errors
from ._api import EntryInfo, invalid, parse_entries, positive_seconds
from ._core import Call, Op, Sleep, op
from ._ops import SandboxCore
from ._streams import CHUNK, ProgressCallback, _abs, _body, _Collect


@dataclass
class FsEvent:
    """A change `files.watch` saw: `type` is "create", "remove" or "modify"."""
    type: str
    path: str


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
