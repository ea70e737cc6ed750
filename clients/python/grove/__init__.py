"""Grove: isolated, snapshot-and-fork sandboxes for agent training. Shaped like the E2B SDK.

    from grove import Sandbox
    with Sandbox.create(image="debian12", cpu=1, memory_mb=512, timeout=300) as sbx:
        print(sbx.exec("echo hi").stdout)
        branches = sbx.snapshot().fork(4)

Connects to the local groved over /run/grove/groved.sock (GROVE_SOCKET), or to GROVE_URL with GROVE_API_KEY.
"""

from ._api import EntryInfo, ExecResult, SandboxInfo
from ._transport import AsyncClient, Client, RetryPolicy
from .async_sandbox import AsyncSandbox, AsyncSnapshot
from .images import Image
from .errors import (CapacityExceeded, Conflict, ConnectionFailed, ForkError, GroveError, InvalidRequest, NotFound,
                     ServerError, Unauthorized, Unavailable, Unsupported)
from .sandbox import Sandbox, Snapshot, Transfer

__all__ = [
    "AsyncClient", "AsyncSandbox", "AsyncSnapshot", "CapacityExceeded", "Client", "Conflict", "ConnectionFailed",
    "EntryInfo", "ExecResult", "ForkError", "GroveError", "Image", "InvalidRequest", "NotFound", "RetryPolicy", "Sandbox",
    "SandboxInfo", "ServerError", "Snapshot", "Transfer", "Unauthorized", "Unavailable", "Unsupported",
]
