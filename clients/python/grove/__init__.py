"""Grove: isolated, snapshot-and-fork sandboxes for agent training. Shaped like the E2B SDK.

    from grove import Sandbox
    with Sandbox.create(image="debian12", cpu=1, memory_mb=512, timeout=300) as sbx:
        print(sbx.exec("echo hi").stdout)
        branches = sbx.snapshot().fork(4)

Connects to the local groved over /run/grove/groved.sock (GROVE_SOCKET), or to GROVE_URL with GROVE_API_KEY.
"""

from ._api import EntryInfo, ExecResult, SandboxInfo
from ._transport import AsyncClient, Client, RetryPolicy
from .async_sandbox import AsyncCommands, AsyncFiles, AsyncProcess, AsyncSandbox, AsyncSnapshot
from .errors import (CapacityExceeded, Conflict, ConnectionFailed, ConnectionLost, ForkError, GroveError,
                     InvalidRequest, NotFound, RequestTimeout, ServerError, StorageFull, Unauthorized, Unavailable,
                     Unsupported)
from .images import AsyncImage, Image
from .lifetime import AsyncLease, Lease
from .sandbox import Commands, Files, FsEvent, Port, Process, Sandbox, Snapshot, Transfer

__all__ = [
    "AsyncClient", "AsyncCommands", "AsyncFiles", "AsyncImage", "AsyncLease", "AsyncProcess", "AsyncSandbox",
    "AsyncSnapshot", "CapacityExceeded", "Client", "Commands", "Conflict", "ConnectionFailed", "ConnectionLost",
    "EntryInfo", "ExecResult", "Files", "ForkError", "FsEvent", "GroveError", "Image", "InvalidRequest", "Lease",
    "NotFound", "Port", "Process", "RequestTimeout", "RetryPolicy", "Sandbox", "SandboxInfo", "ServerError",
    "Snapshot", "StorageFull", "Transfer", "Unauthorized", "Unavailable", "Unsupported",
]
