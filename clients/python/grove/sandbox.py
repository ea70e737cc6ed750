"""The synchronous API: `Sandbox`, its `commands` and `files`, `Process` handles, and `Snapshot`.

Each class is the sync shell of its core in `_ops` (one description of the calls, run blocking);
`async_sandbox` holds the asyncio twins. Other modules hook in with one line in `__init__`."""

from __future__ import annotations

from ._core import shell
from ._commands import CommandsCore, ProcessCore
from ._files import FilesCore, FsEvent
from ._ops import DEFAULT_IMAGE, Port, SandboxCore, SnapshotCore, Transfer
from ._streams import _q
from .pty import Pty
from .sessions import Sessions
from ._transport import Client, default_client

__all__ = ["Client", "Commands", "DEFAULT_IMAGE", "Files", "FsEvent", "Port", "Process", "Sandbox", "Snapshot",
           "Transfer", "_q"]


class Process(shell(ProcessCore, asynchronous=False)):  # type: ignore[misc]
    __doc__ = ProcessCore.__doc__


class Commands(shell(CommandsCore, asynchronous=False)):  # type: ignore[misc]
    __doc__ = CommandsCore.__doc__


class Files(shell(FilesCore, asynchronous=False)):  # type: ignore[misc]
    __doc__ = FilesCore.__doc__


class Sandbox(shell(SandboxCore, asynchronous=False)):  # type: ignore[misc]
    """A Grove sandbox. `Sandbox.create(...)`, then `exec`, `files`, `commands`, `snapshot`, `kill`; or `with`."""

    _default_client = staticmethod(default_client)
    _process_cls = Process
    _commands_cls = Commands
    _files_cls = Files

    def __init__(self, info: dict, client: Client = None):
        super().__init__(info, client)
        # Other modules hook in here, one line each (e.g. `self.sessions = Sessions(self)`).
        self.sessions = Sessions(self)
        self.pty = Pty(self)  # terminals: grove/pty.py

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


class Snapshot(shell(SnapshotCore, asynchronous=False)):  # type: ignore[misc]
    __doc__ = SnapshotCore.__doc__
    _default_client = staticmethod(default_client)
    _sandbox_cls = Sandbox


Sandbox._snapshot_cls = Snapshot
