"""HTTP transport: unix socket or TCP + API key, retries with backoff and jitter on connection errors, 429 and
503 only. Create, fork and delete carry an Idempotency-Key, so a retry never makes a second sandbox."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from . import errors

DEFAULT_SOCKET = "/run/grove/groved.sock"
RETRY_STATUSES = (429, 503)
RETRY_EXCEPTIONS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                    httpx.WriteError, httpx.PoolTimeout)


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
    timeout: float = 60.0

    def resolve(self) -> "Options":
        base_url = self.base_url or os.environ.get("GROVE_URL")
        socket = self.socket or (None if base_url else os.environ.get("GROVE_SOCKET", DEFAULT_SOCKET))
        return Options(socket=socket, base_url=base_url, api_key=self.api_key or os.environ.get("GROVE_API_KEY"),
                       retry=self.retry or RetryPolicy(), timeout=self.timeout)


def _client_kwargs(o: Options, asynchronous: bool) -> dict:
    headers = {}
    if o.api_key:
        headers["Authorization"] = f"Bearer {o.api_key}"
    kw: dict[str, Any] = {"headers": headers, "timeout": httpx.Timeout(o.timeout, connect=10.0),
                          "limits": httpx.Limits(max_connections=200, max_keepalive_connections=64)}
    if o.base_url:
        kw["base_url"] = o.base_url
    else:
        t = httpx.AsyncHTTPTransport if asynchronous else httpx.HTTPTransport
        kw["transport"] = t(uds=o.socket)
        kw["base_url"] = "http://groved"
    return kw


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


class Client:
    """A synchronous connection to groved (thread-safe; share one)."""

    def __init__(self, socket: Optional[str] = None, base_url: Optional[str] = None, api_key: Optional[str] = None,
                 retry: Optional[RetryPolicy] = None, timeout: float = 60.0, transport: Optional[httpx.BaseTransport] = None):
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

    def request(self, method: str, path: str, *, json: Any = None, params: Any = None, content: Any = None,
                headers: Optional[dict] = None, timeout: Optional[float] = None) -> httpx.Response:
        policy = self.options.retry
        for attempt in range(policy.attempts):
            last = attempt == policy.attempts - 1
            try:
                kw = {"timeout": timeout} if timeout is not None else {}
                resp = self._http.request(method, path, json=json, params=params, content=content, headers=headers, **kw)
            except RETRY_EXCEPTIONS as e:
                if last:
                    raise errors.ConnectionFailed(f"cannot reach groved: {e}") from e
                time.sleep(policy.delay(attempt, None))
                continue
            if resp.status_code in RETRY_STATUSES and not last:
                time.sleep(policy.delay(attempt, _retry_after(resp)))
                continue
            raise_for(resp)
            return resp
        raise AssertionError("unreachable")

    def stream(self, method: str, path: str, *, json: Any = None, timeout: Optional[float] = None):
        """A streamed response (SSE); no retries once it has started."""
        return self._http.stream(method, path, json=json, timeout=timeout)


class AsyncClient:
    """An asyncio connection to groved (share one per event loop)."""

    def __init__(self, socket: Optional[str] = None, base_url: Optional[str] = None, api_key: Optional[str] = None,
                 retry: Optional[RetryPolicy] = None, timeout: float = 60.0,
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

    async def request(self, method: str, path: str, *, json: Any = None, params: Any = None, content: Any = None,
                      headers: Optional[dict] = None, timeout: Optional[float] = None) -> httpx.Response:
        policy = self.options.retry
        for attempt in range(policy.attempts):
            last = attempt == policy.attempts - 1
            try:
                kw = {"timeout": timeout} if timeout is not None else {}
                resp = await self._http.request(method, path, json=json, params=params, content=content,
                                                headers=headers, **kw)
            except RETRY_EXCEPTIONS as e:
                if last:
                    raise errors.ConnectionFailed(f"cannot reach groved: {e}") from e
                await asyncio.sleep(policy.delay(attempt, None))
                continue
            if resp.status_code in RETRY_STATUSES and not last:
                await asyncio.sleep(policy.delay(attempt, _retry_after(resp)))
                continue
            raise_for(resp)
            return resp
        raise AssertionError("unreachable")

    def stream(self, method: str, path: str, *, json: Any = None, timeout: Optional[float] = None):
        return self._http.stream(method, path, json=json, timeout=timeout)


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
