"""SWE-ReX on Grove: a deployment whose runtime is SWE-ReX's own `RemoteRuntime`, pointed at the SWE-ReX
protocol groved serves per sandbox (`/v1/sandboxes/{id}/swerex`).

    from grove.swerex import GroveDeployment
    d = GroveDeployment(image="debian12", url="http://127.0.0.1:7070", api_key=KEY)
    await d.start()
    await d.runtime.create_session(CreateBashSessionRequest())
    print((await d.runtime.run_in_session(BashAction(command="ls /"))).output)
    branches = await d.fork(4)   # four deployments, each with the session as it was
    await d.stop()

SWE-ReX's client speaks TCP only (aiohttp), so groved must listen on TCP: `url` (or GROVE_URL) is its address.
Needs `pip install swe-rex aiohttp`.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import DeploymentNotStartedError, DeploymentStartupError
from swerex.runtime.abstract import IsAliveResponse
from swerex.runtime.remote import RemoteRuntime

from . import errors
from ._transport import AsyncClient
from .async_sandbox import AsyncSandbox, AsyncSnapshot

__all__ = ["GroveDeployment"]


class GroveDeployment(AbstractDeployment):
    """A Grove sandbox as a SWE-ReX deployment: `start` creates it from `image`, `runtime` is a `RemoteRuntime`
    on it, `stop` destroys it. `fork(n)` snapshots it (sessions included) into n new deployments."""

    def __init__(self, *, image: str = "debian12", url: Optional[str] = None, api_key: Optional[str] = None,
                 client: Optional[AsyncClient] = None, sandbox: Optional[Dict[str, Any]] = None,
                 startup_timeout: float = 60.0, runtime_timeout: float = 10.0,
                 logger: Optional[logging.Logger] = None, _sandbox_id: Optional[str] = None):
        """`sandbox`: keyword arguments for `AsyncSandbox.create` (cpu, memory_mb, env, labels, timeout, ...).
        `runtime_timeout`: the RemoteRuntime's `is_alive` timeout (SWE-ReX's own default, 0.15 s, is tight for
        a node under load)."""
        self._image = image
        self._url = (url or (client.options.base_url if client else None) or os.environ.get("GROVE_URL") or "")
        self._url = self._url.rstrip("/")
        if not self._url:
            raise ValueError("SWE-ReX's client speaks TCP: give url= (or GROVE_URL) for groved's TCP listener")
        self._api_key = api_key if api_key is not None else (
            (client.options.api_key if client else None) or os.environ.get("GROVE_API_KEY") or "")
        self._client = client
        self._own_client = client is None
        self._create_kw = dict(sandbox or {})
        self._startup_timeout = startup_timeout
        self._runtime_timeout = runtime_timeout
        self._sandbox_id = _sandbox_id
        self._runtime: Optional[RemoteRuntime] = None
        self._snapshots: List[AsyncSnapshot] = []
        self._hooks = CombinedDeploymentHook()
        self.logger = logger or logging.getLogger("grove.swerex")

    # --- AbstractDeployment ----------------------------------------------------------------------------------
    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox_id(self) -> str:
        if self._sandbox_id is None:
            raise DeploymentNotStartedError()
        return self._sandbox_id

    @property
    def runtime(self) -> RemoteRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    async def is_alive(self, *, timeout: Optional[float] = None) -> IsAliveResponse:
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self, *args: Any, **kwargs: Any) -> None:
        """Creates the sandbox (a fork made by `fork` already has one) and waits for its runtime."""
        if self._runtime is not None:
            return
        c = self._grove()
        if self._sandbox_id is None:
            self._hooks.on_custom_step("Creating the Grove sandbox")
            try:
                sbx = await AsyncSandbox.create(self._image, client=c, **self._create_kw)
            except errors.GroveError as e:
                raise DeploymentStartupError(f"creating a Grove sandbox from {self._image!r}: {e}") from e
            self._sandbox_id = sbx.id
        self._runtime = self._runtime_for(self._sandbox_id)
        self._hooks.on_custom_step("Waiting for the runtime")
        try:
            await self._runtime.wait_until_alive(timeout=self._startup_timeout)
        except Exception:
            await self.stop()
            raise

    async def stop(self, *args: Any, **kwargs: Any) -> None:
        """Destroys the sandbox (and the snapshots `fork` made); safe to call twice or before `start`."""
        sid, self._sandbox_id, self._runtime = self._sandbox_id, None, None
        if self._client is None and sid is None and not self._snapshots:
            return
        c = self._grove()
        if sid is not None:
            try:
                await c.request("DELETE", f"/v1/sandboxes/{sid}")
            except errors.NotFound:
                pass
        for s in self._snapshots:
            try:
                await s.delete()
            except errors.GroveError as e:
                self.logger.warning("snapshot %s not deleted: %s", s.name, e)
        self._snapshots = []
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- Grove ------------------------------------------------------------------------------------------------
    async def fork(self, n: int) -> List["GroveDeployment"]:
        """n started deployments restored from a snapshot of this one taken now: files, processes and SWE-ReX
        sessions (cwd, variables, jobs) as they are; each branch then goes its own way. The snapshot is deleted
        when this deployment stops."""
        c = self._grove()
        snap = await (await AsyncSandbox.connect(self.sandbox_id, client=c)).snapshot()
        self._snapshots.append(snap)
        branches = await snap.fork(n)
        out = []
        for b in branches:
            d = GroveDeployment(image=self._image, url=self._url, api_key=self._api_key, client=c,
                                startup_timeout=self._startup_timeout, runtime_timeout=self._runtime_timeout,
                                logger=self.logger, _sandbox_id=b.id)
            d._own_client = False
            d._runtime = d._runtime_for(b.id)
            out.append(d)
        return out

    def _grove(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(base_url=self._url, api_key=self._api_key or None)
            self._own_client = True
        return self._client

    def _runtime_for(self, sandbox_id: str) -> RemoteRuntime:
        return RemoteRuntime(host=f"{self._url}/v1/sandboxes/{sandbox_id}/swerex", port=None,
                             auth_token=self._api_key, timeout=self._runtime_timeout, logger=self.logger)

    def __repr__(self) -> str:
        return f"GroveDeployment({self._sandbox_id or 'not started'})"
