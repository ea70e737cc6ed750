"""SWE-ReX `run_in_session` through Grove against SWE-ReX's own runtimes on the same machine (not part of CI;
run as root from the repository root):

    PYTHONPATH=clients/python /var/lib/grove/venv/bin/python clients/python/tests/swerex_bench.py [n] [--quick]

Three ways to the same bash session, each timed over n runs of one small command (`echo run-<i>`), after 5
warm-up runs:
  - grove:  `RemoteRuntime` -> groved's `/v1/sandboxes/{id}/swerex` -> a Grove session in a sandbox;
  - local:  SWE-ReX's `LocalRuntime` in this process (pexpect on a host bash, no isolation, no HTTP);
  - server: SWE-ReX's own server (`swerex.server`, uvicorn + LocalRuntime) on loopback, via `RemoteRuntime`,
            which is what SWE-ReX deploys inside a container.
Prints p50/p90 and the ratio grove / server. The groved it starts is a throw-away one (conftest's Daemon)."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(__file__))

from swerex.runtime.abstract import BashAction, CreateBashSessionRequest  # noqa: E402
from swerex.runtime.local import LocalRuntime  # noqa: E402
from swerex.runtime.remote import RemoteRuntime  # noqa: E402


async def timed(rt, n: int) -> list:
    await rt.create_session(CreateBashSessionRequest(session="bench"))
    out = []
    for i in range(n + 5):
        t = time.perf_counter()
        r = await rt.run_in_session(BashAction(command=f"echo run-{i}", session="bench", timeout=30))
        dt = time.perf_counter() - t
        assert r.output.strip() == f"run-{i}", r.output
        if i >= 5:
            out.append(dt * 1000)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summary(name: str, ms: list) -> str:
    q = statistics.quantiles(ms, n=10)
    return f"{name:8s} p50 {statistics.median(ms):7.2f} ms   p90 {q[8]:7.2f} ms   n {len(ms)}"


async def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else (20 if "--quick" in sys.argv else 200)
    print(f"load average at start: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    res = {}

    local = LocalRuntime()
    res["local"] = await timed(local, n)
    await local.close()

    port, token = free_port(), uuid.uuid4().hex
    server = subprocess.Popen([sys.executable, "-m", "swerex.server", "--host", "127.0.0.1", "--port", str(port),
                               "--auth-token", token], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rt = RemoteRuntime(host=f"http://127.0.0.1:{port}", port=None, auth_token=token, timeout=5)
        await rt.wait_until_alive(timeout=30)
        res["server"] = await timed(rt, n)
        await rt.close()
    finally:
        server.terminate()
        server.wait(timeout=30)

    from conftest import Daemon
    from grove.swerex import GroveDeployment
    d = Daemon("swerex-bench", tcp=True)
    try:
        d.import_base_image()
        dep = GroveDeployment(url=f"http://{d.tcp}", api_key=d.api_key, sandbox={"memory_mb": 256})
        await dep.start()
        try:
            res["grove"] = await timed(dep.runtime, n)
        finally:
            await dep.stop()
    finally:
        d.stop()

    for k in ("grove", "server", "local"):
        print(summary(k, res[k]))
    g, s = statistics.median(res["grove"]), statistics.median(res["server"])
    print(f"grove / server p50: {g / s:.2f}   grove / local p50: {g / statistics.median(res['local']):.2f}")


if __name__ == "__main__":
    asyncio.run(main())
