"""Streamed request and response bodies (in pieces, with progress) and small helpers the cores share."""

from __future__ import annotations

import base64
import io
import os
import stat
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Optional, Tuple, Union
from urllib.parse import quote

from ._api import ExecResult, SseParser, invalid, parse_exec

OutputCallback = Callable[[str], None]
#: `on_progress(done_bytes, total_bytes_or_None)` during an upload or download.
ProgressCallback = Callable[[int, Optional[int]], None]
#: Bytes per piece of a streamed upload.
CHUNK = 1 << 20
#: A body at most this big is sent as one buffer.
SMALL = 256 << 10


def _q(s: str) -> str:
    return quote(s, safe="")


def _abs(field: str, path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise invalid(field, f"{path!r} is not an absolute path in the sandbox")
    return path


class _Chunks:
    """A request body sent a piece at a time, with progress; `length`, when known, goes out as Content-Length
    (cheaper for both ends than chunked framing)."""

    def __init__(self, src: Union[bytes, BinaryIO, Iterable[bytes]], length: Optional[int],
                 on_progress: Optional[ProgressCallback]):
        self.src, self.length, self.on_progress = src, length, on_progress

    def __iter__(self) -> Iterator[bytes]:
        src, done = self.src, 0
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
            if self.on_progress:
                self.on_progress(done, self.length)


_chunks = _Chunks


def _body(data: Any, on_progress: Optional[ProgressCallback]) -> Any:
    """What to send: small buffers whole, anything else streamed in pieces (with progress)."""
    if isinstance(data, str):
        data = data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        if len(data) <= SMALL and on_progress is None:
            return bytes(data)
        return _Chunks(data, len(data), on_progress)
    total = None
    if hasattr(data, "fileno"):
        try:
            st = os.fstat(data.fileno())
            total = st.st_size - data.tell() if stat.S_ISREG(st.st_mode) else None
        except (OSError, ValueError, io.UnsupportedOperation):
            total = None
    return _Chunks(data, total, on_progress)


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


class _Events:
    """A Server-Sent Events response, parsed as it arrives: `on_event(event, data)` for each one until an event
    in `final` (kept in `last`) ends it."""

    def __init__(self, on_event: Callable[[str, Any], None], final: Iterable[str] = ("done", "error")):
        self.p = SseParser()
        self.pending = b""
        self.on_event = on_event
        self.final = set(final)
        self.last: Optional[Tuple[str, Any]] = None

    def __call__(self, chunk: bytes) -> bool:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        for raw in lines:
            got = self.p.feed(raw.decode("utf-8").rstrip("\r"))
            if got is None:
                continue
            self.on_event(*got)
            if got[0] in self.final:
                self.last = got
                return True
        return False
