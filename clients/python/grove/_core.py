"""One description of every call, run by a thin sync or asyncio shell, so the two clients cannot drift.

Each public operation is written once, as a generator that yields what it needs done: a `Call` (one HTTP
request, answered with its `httpx.Response`) or a `Sleep`. `shell()` turns a core class into its sync twin
(each operation driven by `drive_sync`) or its asyncio twin (`drive_async`), method for method, with the same
names, signatures and docs. A `GroveError` raised by a request is thrown back into the operation, which may
catch it (`kill` of a gone sandbox is fine)."""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generator, Optional, Set

from .errors import GroveError, RequestTimeout


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


#: A request's timeout when it gives none: the client's own (`Client(timeout=...)`).
DEFAULT: Any = _Default()


@dataclass
class Call:
    """One HTTP request. `sink`, when set, gets the response body chunk by chunk as it arrives (a True return
    stops reading); else the body is read whole. `idempotent`: None means by method (GET, PUT, DELETE) or by
    an Idempotency-Key header; only idempotent calls are retried once a request may have reached groved."""

    client: Any
    method: str
    path: str
    json: Any = None
    params: Any = None
    content: Any = None
    headers: Optional[Dict[str, str]] = None
    timeout: Any = DEFAULT
    idempotent: Optional[bool] = None
    sink: Optional[Callable[[bytes], Optional[bool]]] = None
    queue_timeout: Optional[float] = None
    #: Sent (best effort) when the caller gives up on this call: its deadline passed, the task was
    #: cancelled, Ctrl-C. An exec's ends the command in the sandbox.
    on_abandon: Optional["Call"] = None


@dataclass
class Sleep:
    seconds: float


Op = Generator[Any, Any, Any]


def op(fn: Callable[..., Op]) -> Callable[..., Op]:
    """Marks a generator method as a public operation for `shell()` to wrap."""
    fn._grove_op = True  # type: ignore[attr-defined]
    return fn


def _abandon_sync(step: Any) -> None:
    a = getattr(step, "on_abandon", None)
    if a is not None:
        try:
            a.client.send(a)
        except GroveError:
            pass


_abandoning: Set["asyncio.Future[Any]"] = set()


def _abandon_async(step: Any) -> None:
    """Sends the call's `on_abandon` without waiting for it (a cancelled caller must not be held up)."""
    a = getattr(step, "on_abandon", None)
    if a is None:
        return

    async def go() -> None:
        try:
            await a.client.send(a)
        except GroveError:
            pass

    f = asyncio.ensure_future(go())
    _abandoning.add(f)
    f.add_done_callback(_abandoning.discard)


def drive_sync(gen: Op) -> Any:
    value: Any = None
    exc: Optional[BaseException] = None
    try:
        while True:
            try:
                step = gen.throw(exc) if exc is not None else gen.send(value)
            except StopIteration as s:
                return s.value
            value, exc = None, None
            try:
                if isinstance(step, Sleep):
                    time.sleep(step.seconds)
                else:
                    value = step.client.send(step)
            except RequestTimeout as e:
                _abandon_sync(step)
                exc = e
            except GroveError as e:
                exc = e
            except KeyboardInterrupt:
                _abandon_sync(step)
                raise
    finally:
        gen.close()  # an interrupted operation's own cleanup (temp files) runs now


async def drive_async(gen: Op) -> Any:
    value: Any = None
    exc: Optional[BaseException] = None
    try:
        while True:
            try:
                step = gen.throw(exc) if exc is not None else gen.send(value)
            except StopIteration as s:
                return s.value
            value, exc = None, None
            try:
                if isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    value = await step.client.send(step)
            except RequestTimeout as e:
                _abandon_async(step)
                exc = e
            except GroveError as e:
                exc = e
            except asyncio.CancelledError:
                _abandon_async(step)
                raise
    finally:
        gen.close()


def _wrap(v: Any, asynchronous: bool) -> Any:
    is_cm = isinstance(v, classmethod)
    fn = v.__func__ if is_cm else v
    if asynchronous:
        @functools.wraps(fn)
        async def w(self, *a, **kw):
            return await drive_async(fn(self, *a, **kw))
    else:
        @functools.wraps(fn)
        def w(self, *a, **kw):
            return drive_sync(fn(self, *a, **kw))
    w._grove_op = True  # type: ignore[attr-defined]
    return classmethod(w) if is_cm else w


def is_op(v: Any) -> bool:
    return bool(getattr(v.__func__ if isinstance(v, (classmethod, staticmethod)) else v, "_grove_op", False))


def shell(core: type, *, asynchronous: bool) -> type:
    """A base for the sync or asyncio class of `core`: every `@op` of it (and its bases) driven the one way.
    The public class subclasses it (`class Sandbox(shell(SandboxCore, asynchronous=False))`) and adds only
    what differs: its default client, the classes it makes, `with`/`async with`, and other modules' hooks."""
    ns: Dict[str, Any] = {"__module__": core.__module__, "__doc__": core.__doc__}
    for klass in reversed(core.__mro__):
        for k, v in vars(klass).items():
            if is_op(v):
                ns[k] = _wrap(v, asynchronous)
    return type(f"{core.__name__}{'Async' if asynchronous else 'Sync'}", (core,), ns)
