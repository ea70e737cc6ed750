"""A trainer's lease on its sandboxes: they live while it heartbeats and die with it.

    with grove.Lease(ttl=60) as lease:          # async: `async with grove.AsyncLease(ttl=60) as lease`
        sbxs = [lease.create() for _ in range(32)]
        branches = lease.fork(sbxs[0].snapshot(), 8)

Every sandbox made through the lease carries the label `grove.lease=<id>` and a TTL of `ttl` seconds, which a
heartbeat (a thread, or an asyncio task) renews every `heartbeat` seconds. Leaving the block deletes them all
in one request (by label). If the trainer dies (SIGKILL, OOM, a lost node), heartbeats stop and groved reaps the
sandboxes when their TTL runs out: nothing leaks longer than `ttl`."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any, Dict, Optional

from . import errors
from ._api import invalid, lifetime_secs, positive_seconds
from ._core import Call, Op, op, shell
from ._ops import SandboxCore, SnapshotCore
from ._transport import default_async_client, default_client
from .async_sandbox import AsyncSandbox
from .sandbox import Sandbox

LEASE_LABEL = "grove.lease"


class LeaseCore:
    """Sandboxes that live only as long as this lease is held (see the module doc)."""

    _default_client: Any
    _sandbox_cls: type

    def __init__(self, client: Any = None, *, ttl: float = 60, heartbeat: Optional[float] = None,
                 labels: Optional[Dict[str, str]] = None, name: Optional[str] = None):
        self._c = client or type(self)._default_client()
        self.ttl = lifetime_secs("ttl", ttl)
        self.heartbeat = positive_seconds("heartbeat", heartbeat) or max(0.5, self.ttl / 3)
        if self.heartbeat >= self.ttl:
            raise invalid("heartbeat", f"{self.heartbeat} s is not shorter than the ttl ({self.ttl} s)")
        self.id = name or f"lease-{uuid.uuid4().hex[:12]}"
        self.labels = {**(labels or {}), LEASE_LABEL: self.id}
        self.sandboxes: Dict[str, Any] = {}

    def _labels(self, extra: Optional[Dict[str, str]]) -> Dict[str, str]:
        return {**(extra or {}), **self.labels}

    @op
    def create(self, image: Optional[str] = None, *, labels: Optional[Dict[str, str]] = None, **kw: Any) -> Op:
        """`Sandbox.create` under the lease (its labels and TTL)."""
        if "timeout" in kw:
            raise invalid("timeout", "a leased sandbox lives for the lease's ttl")
        create = SandboxCore.create.__func__  # type: ignore[attr-defined]
        sbx = yield from create(self._sandbox_cls, image, client=self._c, labels=self._labels(labels),
                                timeout=self.ttl, **kw)
        self.sandboxes[sbx.id] = sbx
        return sbx

    @op
    def create_many(self, count: int, image: Optional[str] = None, *, labels: Optional[Dict[str, str]] = None,
                    **kw: Any) -> Op:
        """`Sandbox.create_many` under the lease: one request for `count` sandboxes."""
        if "timeout" in kw:
            raise invalid("timeout", "a leased sandbox lives for the lease's ttl")
        many = SandboxCore.create_many.__func__  # type: ignore[attr-defined]
        try:
            made = yield from many(self._sandbox_cls, count, image, client=self._c, labels=self._labels(labels),
                                   timeout=self.ttl, **kw)
        except errors.ForkError as e:
            self.sandboxes.update({s.id: s for s in e.sandboxes})
            raise
        self.sandboxes.update({s.id: s for s in made})
        return made

    @op
    def fork(self, snapshot: Any, n: int = 1, *, labels: Optional[Dict[str, str]] = None, **kw: Any) -> Op:
        """`snapshot.fork(n)` under the lease."""
        try:
            made = yield from SnapshotCore.fork(snapshot, n, labels=self._labels(labels), timeout=self.ttl, **kw)
        except errors.ForkError as e:
            self.sandboxes.update({s.id: s for s in e.sandboxes})
            raise
        self.sandboxes.update({s.id: s for s in made})
        return made

    @op
    def renew(self) -> Op:
        """One heartbeat: every sandbox of the lease gets `ttl` seconds more (gone ones are forgotten)."""
        for sid in list(self.sandboxes):
            try:
                yield Call(self._c, "PUT", f"/v1/sandboxes/{sid}/ttl", json={"ttl_secs": self.ttl})
            except errors.NotFound:
                self.sandboxes.pop(sid, None)

    @op
    def close(self) -> Op:
        """Deletes every sandbox of the lease (made through it or not, by its label), in one request."""
        r = yield Call(self._c, "POST", "/v1/sandboxes/delete", json={"ids": [], "labels": {LEASE_LABEL: self.id}},
                       timeout=None, idempotent=True)
        self.sandboxes.clear()
        return [d["id"] for d in r.json()["results"] if d.get("deleted")]


class Lease(shell(LeaseCore, asynchronous=False)):  # type: ignore[misc]
    __doc__ = LeaseCore.__doc__
    _default_client = staticmethod(default_client)
    _sandbox_cls = Sandbox

    def __enter__(self) -> "Lease":
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._run, name=f"grove-{self.id}", daemon=True)
        self._beat.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                self.renew()
            except errors.GroveError:
                pass  # the next beat tries again; the TTL covers the gap

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._beat.join()
        self.close()


class AsyncLease(shell(LeaseCore, asynchronous=True)):  # type: ignore[misc]
    __doc__ = LeaseCore.__doc__
    _default_client = staticmethod(default_async_client)
    _sandbox_cls = AsyncSandbox

    async def __aenter__(self) -> "AsyncLease":
        self._beat = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            try:
                await self.renew()
            except errors.GroveError:
                pass

    async def __aexit__(self, *exc) -> None:
        self._beat.cancel()
        try:
            await self._beat
        except asyncio.CancelledError:
            pass
        await self.close()
