"""HTTP transport: unix socket or TCP + API key. No httpx exception leaves it: each becomes a `GroveError`.

Retries (backoff with jitter) only where a second attempt cannot do a thing twice: a connection that could
not be made (nothing was sent), a 429/503 (groved did nothing), and a broken connection only for calls that are
idempotent by method (GET, PUT, DELETE) or carry an `Idempotency-Key` groved honours (create, fork, delete). An
exec or snapshot whose connection breaks is never sent again: `ConnectionLost` says it may have run."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable, Optional

import httpx

from . import errors
from ._core import DEFAULT, Call

DEFAULT_SOCKET = "/run/grove/groved.sock"
RETRY_STATUSES = (429, 503)
#: Nothing reached groved: safe to send again whatever the call.
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: The connection broke once the request may have been sent.
BROKEN = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.CloseError)
IDEMPOTENT_METHODS = ("GET", "HEAD", "PUT", "DELETE", "OPTIONS")
CONNECT_TIMEOUT = 10.0


@dataclass
class RetryPolicy:
    attempts: int = 6
    base_delay: float = 0.1
    max_delay: float = 5.0

    def delay(self, attempt: int, retry_after: Optional[float]) -> float:
        # Full jitter, exponential; a server's Retry-After is a floor.
        d = random.uniform(0, min(self.max_delay, self.base_delay * (2 ** attempt)))
        if retry_after is not None:
            d = max(d, min(retry_after, self.max_delay))
        return d


@dataclass
class Options:
    socket: Optional[str] = None
    base_url: Optional[str] = None
    api_key: Optional[str] = None
    retry: Optional[RetryPolicy] = None
    #: Seconds to wait for an answer to a short call (lookups, listings); None: no limit. Commands, creates,
    #: forks, snapshots and transfers take as long as they take, bounded only by their own `timeout`.
    timeout: Optional[float] = 60.0

    def resolve(self) -> "Options":
        base_url = self.base_url or os.environ.get("GROVE_URL")
        socket = self.socket or (None if base_url else os.environ.get("GROVE_SOCKET", DEFAULT_SOCKET))
        if self.timeout is not None and not self.timeout > 0:
            raise errors.InvalidRequest(f"{self.timeout!r} is not a positive number of seconds (None: no limit)",
                                        field="timeout", code="invalid_argument")
        return Options(socket=socket, base_url=base_url, api_key=self.api_key or os.environ.get("GROVE_API_KEY"),
                       retry=self.retry or RetryPolicy(), timeout=self.timeout)

    @property
    def where(self) -> str:
        return self.base_url if self.base_url else f"unix socket {self.socket}"


def _client_kwargs(o: Options, asynchronous: bool) -> dict:
    headers = {}
    if o.api_key:
        headers["Authorization"] = f"Bearer {o.api_key}"
    kw: dict[str, Any] = {"headers": headers, "timeout": _timeout(o.timeout),
                          "limits": httpx.Limits(max_connections=200, max_keepalive_connections=64)}
    if o.base_url:
        kw["base_url"] = o.base_url
    else:
        t = httpx.AsyncHTTPTransport if asynchronous else httpx.HTTPTransport
        kw["transport"] = t(uds=o.socket)
        kw["base_url"] = "http://groved"
    return kw


def _timeout(seconds: Optional[float]) -> httpx.Timeout:
    if seconds is None:
        return httpx.Timeout(None, connect=CONNECT_TIMEOUT)
    return httpx.Timeout(seconds, connect=min(CONNECT_TIMEOUT, seconds))


def _retry_after(resp: httpx.Response) -> Optional[float]:
    v = resp.headers.get("retry-after")
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None


def raise_for(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        body = resp.json()
    except ValueError:
        body = {"message": resp.text}
    raise errors.from_response(resp.status_code, body, _retry_after(resp))


def idempotency_headers() -> dict:
    return {"Idempotency-Key": uuid.uuid4().hex}


def _idempotent(call: Call) -> bool:
    if call.idempotent is not None:
        return call.idempotent
    return call.method in IDEMPOTENT_METHODS or any(k.lower() == "idempotency-key" for k in (call.headers or {}))


class _Body:
    """A streamed request body, noting whether any of it was taken (then it cannot be sent again)."""

    def __init__(self, chunks: Iterable[bytes]):
        self.chunks = chunks
        self.started = False

    def __iter__(self):
        self.started = True
        for c in self.chunks:
            yield bytes(c)


class _AsyncBody:
    """The same for httpx's AsyncClient, which takes only async iterables."""

    def __init__(self, chunks: Any):
        self.chunks = chunks
        self.started = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self.started = True
        if hasattr(self.chunks, "__aiter__"):
            async for c in self.chunks:  # type: ignore[union-attr]
                yield bytes(c)
        else:
            for c in self.chunks:
                yield bytes(c)


class _Attempts:
    """The retry decisions both transports share."""

    def __init__(self, options: Options, call: Call, asynchronous: bool = False):
        self.o, self.call = options, call
        self.idempotent = _idempotent(call)
        self.t0 = time.monotonic()
        c = call.content
        streamed = c is not None and not isinstance(c, (bytes, bytearray, memoryview, str))
        self.body: Any = (_AsyncBody if asynchronous else _Body)(c) if streamed else None
        #: Whether the response sink has been given bytes: then a second attempt would repeat them.
        self.received = False

    def sink(self, chunk: bytes) -> Optional[bool]:
        self.received = True
        assert self.call.sink is not None
        return self.call.sink(chunk)

    def kwargs(self) -> dict:
        c = self.call
        headers = c.headers
        length = getattr(c.content, "length", None)
        if self.body is not None and length is not None:
            headers = {**(headers or {}), "content-length": str(length)}
        kw: dict = {"json": c.json, "params": c.params, "headers": headers,
                    "content": self.body if self.body is not None else c.content}
        if c.timeout is not DEFAULT:
            kw["timeout"] = _timeout(c.timeout)
        return kw

    def replayable(self) -> bool:
        return (self.body is None or not self.body.started) and not self.received

    def on_error(self, e: Exception, attempt: int) -> float:
        """Seconds to wait before the next attempt, or raises the error as a GroveError."""
        last = attempt >= self.o.retry.attempts - 1
        what = f"{self.call.method} {self.call.path}"
        if isinstance(e, NOT_SENT):
            if not last and self.replayable():
                return self.o.retry.delay(attempt, None)
            raise errors.ConnectionFailed(f"cannot reach groved at {self.o.where} ({what}): {_why(e)}",
                                          code="connection_failed") from e
        if isinstance(e, httpx.TimeoutException):
            raise errors.RequestTimeout(f"no answer from groved at {self.o.where} within the client's deadline "
                                        f"({what}); the connection was closed", code="client_timeout") from e
        if isinstance(e, BROKEN):
            if self.idempotent and not last and self.replayable():
                return self.o.retry.delay(attempt, None)
            again = "" if self.idempotent else "; not sent again since it is not idempotent (it may have run)"
            raise errors.ConnectionLost(f"the connection to groved at {self.o.where} broke during {what}: "
                                        f"{_why(e)}{again}", code="connection_lost") from e
        raise errors.GroveError(f"request to groved at {self.o.where} failed ({what}): {_why(e)}",
                                code="client_error") from e

    def on_status(self, resp: httpx.Response, attempt: int) -> Optional[float]:
        """Seconds to wait before trying again, or None: the answer stands."""
        if resp.status_code not in RETRY_STATUSES or attempt >= self.o.retry.attempts - 1 or not self.replayable():
            return None
        d = self.o.retry.delay(attempt, _retry_after(resp))
        qt = self.call.queue_timeout
        if qt is not None and time.monotonic() - self.t0 + d > qt:
            return None
        return d


def _why(e: Exception) -> str:
    return str(e) or type(e).__name__


HTTPX_ERRORS = (httpx.HTTPError, httpx.StreamError, httpx.InvalidURL)


class Client:
    """A synchronous connection to groved (thread-safe; share one). `timeout`: seconds for short calls."""

    def __init__(self, socket: Optional[str] = None, base_url: Optional[str] = None, api_key: Optional[str] = None,
                 retry: Optional[RetryPolicy] = None, timeout: Optional[float] = 60.0,
                 transport: Optional[httpx.BaseTransport] = None):
        self.options = Options(socket, base_url, api_key, retry, timeout).resolve()
        kw = _client_kwargs(self.options, asynchronous=False)
        if transport is not None:
            kw["transport"] = transport
        self._http = httpx.Client(**kw)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, call: Call) -> httpx.Response:
        a = _Attempts(self.options, call)
        attempt = 0
        while True:
            try:
                resp = self._once(call, a)
            except HTTPX_ERRORS as e:
                time.sleep(a.on_error(e, attempt))
                attempt += 1
                continue
            d = a.on_status(resp, attempt)
            if d is None:
                raise_for(resp)
                return resp
            time.sleep(d)
            attempt += 1

    def _once(self, call: Call, a: _Attempts) -> httpx.Response:
        if call.sink is None:
            return self._http.request(call.method, call.path, **a.kwargs())
        with self._http.stream(call.method, call.path, **a.kwargs()) as r:
            if not r.is_success:
                r.read()
                return r
            for chunk in r.iter_bytes():
                if a.sink(chunk):
                    break
            return r

    def request(self, method: str, path: str, *, json: Any = None, params: Any = None, content: Any = None,
                headers: Optional[dict] = None, timeout: Any = DEFAULT) -> httpx.Response:
        return self.send(Call(self, method, path, json=json, params=params, content=content, headers=headers,
                              timeout=timeout))

    def stream(self, method: str, path: str, *, json: Any = None, timeout: Optional[float] = None):
        """A streamed response read by its caller (a terminal's SSE); never retried once sent."""
        return self._http.stream(method, path, json=json, timeout=_timeout(timeout))


class AsyncClient:
    """An asyncio connection to groved (share one per event loop). `timeout`: seconds for short calls."""

    def __init__(self, socket: Optional[str] = None, base_url: Optional[str] = None, api_key: Optional[str] = None,
                 retry: Optional[RetryPolicy] = None, timeout: Optional[float] = 60.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None):
        self.options = Options(socket, base_url, api_key, retry, timeout).resolve()
        kw = _client_kwargs(self.options, asynchronous=True)
        if transport is not None:
            kw["transport"] = transport
        self._http = httpx.AsyncClient(**kw)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def send(self, call: Call) -> httpx.Response:
        a = _Attempts(self.options, call, asynchronous=True)
        attempt = 0
        while True:
            try:
                resp = await self._once(call, a)
            except HTTPX_ERRORS as e:
                await asyncio.sleep(a.on_error(e, attempt))
                attempt += 1
                continue
            d = a.on_status(resp, attempt)
            if d is None:
                raise_for(resp)
                return resp
            await asyncio.sleep(d)
            attempt += 1

    async def _once(self, call: Call, a: _Attempts) -> httpx.Response:
        if call.sink is None:
            return await self._http.request(call.method, call.path, **a.kwargs())
        async with self._http.stream(call.method, call.path, **a.kwargs()) as r:
            if not r.is_success:
                await r.aread()
                return r
            async for chunk in r.aiter_bytes():
                if a.sink(chunk):
                    break
            return r

    async def request(self, method: str, path: str, *, json: Any = None, params: Any = None, content: Any = None,
                      headers: Optional[dict] = None, timeout: Any = DEFAULT) -> httpx.Response:
        return await self.send(Call(self, method, path, json=json, params=params, content=content, headers=headers,
                                    timeout=timeout))

    def stream(self, method: str, path: str, *, json: Any = None, timeout: Optional[float] = None):
        """A streamed response read by its caller (`async with`); never retried once sent."""
        return self._http.stream(method, path, json=json, timeout=_timeout(timeout))


_default_sync: Optional[Client] = None
_default_async: dict = {}


def default_client() -> Client:
    global _default_sync
    if _default_sync is None:
        _default_sync = Client()
    return _default_sync


def default_async_client() -> AsyncClient:
    loop = asyncio.get_running_loop()
    c = _default_async.get(id(loop))
    if c is None or c[0] is not loop:
        c = (loop, AsyncClient())
        _default_async[id(loop)] = c
    return c[1]
