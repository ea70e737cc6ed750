"""The asyncio API: `AsyncSandbox`, `AsyncSnapshot` and friends, the asyncio shells of the cores in `_ops`: the
same operations as the sync classes by construction (tests/test_surface.py holds them to it)."""

from __future__ import annotations

from ._core import shell
from ._commands import CommandsCore, ProcessCore
from ._files import FilesCore
from ._ops import SandboxCore, SnapshotCore
from .pty import AsyncPty
from .sessions import AsyncSessions
from ._transport import AsyncClient, default_async_client

__all__ = ["AsyncCommands", "AsyncFiles", "AsyncProcess", "AsyncSandbox", "AsyncSnapshot"]


class AsyncProcess(shell(ProcessCore, asynchronous=True)):  # type: ignore[misc]
    __doc__ = ProcessCore.__doc__


class AsyncCommands(shell(CommandsCore, asynchronous=True)):  # type: ignore[misc]
    __doc__ = CommandsCore.__doc__


class AsyncFiles(shell(FilesCore, asynchronous=True)):  # type: ignore[misc]
    __doc__ = FilesCore.__doc__


class AsyncSandbox(shell(SandboxCore, asynchronous=True)):  # type: ignore[misc]
    """A Grove sandbox for asyncio: `await AsyncSandbox.create(...)`, then the same calls as `Sandbox`, awaited."""

    _default_client = staticmethod(default_async_client)
    _process_cls = AsyncProcess
    _commands_cls = AsyncCommands
    _files_cls = AsyncFiles

    def __init__(self, info: dict, client: AsyncClient = None):
        super().__init__(info, client)
        # Other modules hook in here, one line each (e.g. `self.sessions = Sessions(self)`).
        self.sessions = AsyncSessions(self)
        self.pty = AsyncPty(self)  # terminals: grove/pty.py

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.kill()


class AsyncSnapshot(shell(SnapshotCore, asynchronous=True)):  # type: ignore[misc]
    __doc__ = SnapshotCore.__doc__
    _default_client = staticmethod(default_async_client)
    _sandbox_cls = AsyncSandbox


AsyncSandbox._snapshot_cls = AsyncSnapshot
