"""A Grove fleet on one machine, for tests: N nodes, each a network namespace (veth to a private bridge, its own
address) holding a groved (own state/run dirs, cgroup root, TCP address with an API key) and a Ray node started by
`python -m grove.ray.node`; the first node is the Ray head. Everything lives under one private temp dir and is torn
down to zero residue: processes (found by network namespace), namespaces, links, cgroups, files."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

import httpx

from conftest import BASE_IMAGE_DIR, IMAGE, binary

CLONE_NEWNET = 0x40000000
GROVED_PORT = 7070
RAY_PORT = 6379
# Ray notices a dead raylet after period x threshold; the defaults (3 s x 5) make the loss test slow.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "500",
           "RAY_health_check_failure_threshold": "3", "RAY_health_check_timeout_ms": "1000"}
_libc = ctypes.CDLL(None, use_errno=True)


def sh(*args: str) -> None:
    subprocess.run(args, check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def setns(path: str) -> None:
    """Moves the calling thread into the network namespace at `path` (threads it starts later follow it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {path}")
    finally:
        os.close(fd)


def pids_in_netns(ns_path: str) -> List[int]:
    ino = os.stat(ns_path).st_ino
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if os.stat(p / "ns" / "net").st_ino == ino:
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


class Node:
    def __init__(self, cluster: "Cluster", index: int, sandboxes: int, labels: Dict[str, str]):
        self.cluster, self.index = cluster, index
        self.name = f"n{index}"
        self.ns = f"{cluster.prefix}n{index}"
        self.ns_path = f"/run/netns/{self.ns}"
        self.ip = f"{cluster.subnet}.{index}"
        self.url = f"http://{self.ip}:{GROVED_PORT}"
        self.dir = cluster.dir / self.name
        self.socket = str(self.dir / "run" / "groved.sock")
        self.cgroup_root = f"grove-{cluster.prefix}n{index}"
        self.capacity = sandboxes
        self.labels = labels
        self.groved: Optional[subprocess.Popen] = None
        self.ray_node_id: Optional[str] = None

    def plumb(self) -> None:
        c, host, peer = self.cluster, f"{self.cluster.prefix}h{self.index}", f"{self.cluster.prefix}p{self.index}"
        sh("ip", "netns", "add", self.ns)
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", host, "master", c.bridge, "up")
        sh("ip", "link", "set", peer, "netns", self.ns)
        sh("ip", "-n", self.ns, "link", "set", peer, "name", "eth0")
        sh("ip", "-n", self.ns, "addr", "add", f"{self.ip}/24", "dev", "eth0")
        sh("ip", "-n", self.ns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.ns, "link", "set", "lo", "up")

    def start_groved(self) -> None:
        (self.dir / "state").mkdir(parents=True, exist_ok=True)
        (self.dir / "run").mkdir(parents=True, exist_ok=True)
        labels = "\n".join(f'{k} = "{v}"' for k, v in self.labels.items())
        (self.dir / "groved.toml").write_text(f"""
state_dir = "{self.dir}/state"
run_dir = "{self.dir}/run"
socket = "{self.socket}"
listen = ["{self.ip}:{GROVED_PORT}"]
api_key_file = "{self.cluster.key_file}"
root_provider = "nodefs"
cgroup_root = "{self.cgroup_root}"
reap_interval_ms = 200
net_pool = "10.218.{self.index}.0/24"
[capacity]
memory_mb = 16384
memory_reserve_mb = 0
sandboxes = {self.capacity}
[defaults]
cpu_millis = 250
memory_mb = 128
pids = 256
open_files = 1024
disk_mb = 512
[labels]
{labels}
""")
        env = dict(os.environ, GROVE_INIT_BINARY=str(binary("GROVE_INIT_BINARY", "grove-init")), GROVE_LOG="info")
        log = open(self.dir / "groved.log", "a")
        self.groved = subprocess.Popen(
            ["nsenter", f"--net={self.ns_path}", str(binary("GROVED_BIN", "groved")), "--config",
             str(self.dir / "groved.toml")], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env)
        log.close()
        deadline = time.time() + 60
        while True:
            try:
                with self.http() as h:
                    if h.get("/v1/health").status_code == 200:
                        return
            except httpx.TransportError:
                pass
            if self.groved.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"groved on {self.name} did not start:\n{self.log()}")
            time.sleep(0.05)

    def http(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://g", timeout=300)

    def log(self) -> str:
        try:
            return (self.dir / "groved.log").read_text()[-4000:]
        except OSError:
            return ""

    def import_image(self) -> None:
        with self.http() as h:
            r = h.post("/v1/images", json={"name": IMAGE, "source": "dir", "path": BASE_IMAGE_DIR})
            assert r.status_code == 201, r.text

    def info(self) -> dict:
        with self.http() as h:
            return h.get("/v1/node").json()

    def start_ray(self) -> None:
        args = [sys.executable, "-m", "grove.ray.node", "--groved-url", self.url, "--api-key-file",
                str(self.cluster.key_file)]
        args += ["--head", "--port", str(RAY_PORT)] if self.index == 1 else [
            "--address", f"{self.cluster.subnet}.1:{RAY_PORT}"]
        args += ["--", f"--temp-dir={self.cluster.dir / 'ray'}", "--object-store-memory=78643200"]
        r = subprocess.run(["nsenter", f"--net={self.ns_path}", *args], env=dict(os.environ, **RAY_ENV),
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"ray start on {self.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")

    def kill(self) -> None:
        """The node dies: groved and every Ray process on it get SIGKILL (its sandboxes stay orphaned until
        groved comes back and sweeps them)."""
        for pid in pids_in_netns(self.ns_path):
            os.kill(pid, signal.SIGKILL)
        if self.groved is not None:
            self.groved.wait()

    def stop_ray(self) -> None:
        """SIGTERM then SIGKILL to every process in the namespace but groved."""
        keep = {self.groved.pid} if self.groved and self.groved.poll() is None else set()
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            left = [p for p in pids_in_netns(self.ns_path) if p not in keep]
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait
            while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in left):
                time.sleep(0.05)

    def stop_groved(self) -> List[str]:
        """SIGTERM; returns what it left (residue the daemon reports, mounts, cgroups)."""
        left = []
        if self.groved is not None and self.groved.poll() is None:
            with self.http() as h:
                res = h.get("/v1/node/residue").json()
            self.groved.send_signal(signal.SIGTERM)
            try:
                self.groved.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.groved.kill()
                self.groved.wait()
                left.append(f"{self.name}: groved ignored SIGTERM")
            if self.groved.returncode != 0:
                left.append(f"{self.name}: groved exit {self.groved.returncode}\n{self.log()}")
            if not res.get("clean"):
                left.append(f"{self.name}: residue {res}")
        d = str(self.dir)
        left += [f"{self.name}: mount {l}" for l in Path("/proc/self/mountinfo").read_text().splitlines() if d in l]
        for ctrl in Path("/sys/fs/cgroup").iterdir():
            root = ctrl / self.cgroup_root
            if root.is_dir():
                left += [f"{self.name}: cgroup {p}" for p in root.iterdir() if p.is_dir()]
        return left


class Cluster:
    def __init__(self, specs: List[dict]):
        tag = uuid.uuid4().hex[:4]
        self.prefix = f"gf{tag}"
        self.bridge = f"{self.prefix}br"
        used = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        third = random.choice([x for x in range(1, 250) if f"10.215.{x}." not in used])
        self.subnet = f"10.215.{third}"
        self.dir = Path(f"/tmp/grove-fleet-{tag}")
        self.dir.mkdir()
        self.api_key = uuid.uuid4().hex
        self.key_file = self.dir / "api-key"
        self.key_file.write_text(self.api_key)
        self.nodes = [Node(self, i + 1, s["sandboxes"], s.get("labels", {})) for i, s in enumerate(specs)]
        self._host_ns = os.open("/proc/self/ns/net", os.O_RDONLY)

    def start(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for n in self.nodes:
            n.plumb()
        for n in self.nodes:
            n.start_groved()
        errs: List[BaseException] = []

        def imp(n: Node) -> None:
            try:
                n.import_image()
            except BaseException as e:  # noqa: BLE001 - reported below
                errs.append(e)

        ts = [threading.Thread(target=imp, args=(n,)) for n in self.nodes]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]
        for n in self.nodes:
            n.start_ray()

    def enter(self) -> None:
        """This thread joins the head node's network: a Ray driver needs a raylet on its own address."""
        setns(self.nodes[0].ns_path)

    def leave(self) -> None:
        if _libc.setns(self._host_ns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns back to the host namespace")

    def teardown(self) -> List[str]:
        """Stops everything; returns what was left behind (empty on success)."""
        left: List[str] = []
        for n in reversed(self.nodes):
            if Path(n.ns_path).exists():
                n.stop_ray()
        for n in self.nodes:
            if Path(n.ns_path).exists():
                left += n.stop_groved()
                stray = [f"{n.name}: process {p} {comm(p)}" for p in pids_in_netns(n.ns_path)]
                left += stray
                if not stray:
                    # Threads a Ray driver started in the head's namespace may pin it until this process exits:
                    # take the veth down with us rather than wait for the namespace to go.
                    subprocess.run(["ip", "link", "del", f"{self.prefix}h{n.index}"], check=False,
                                   stderr=subprocess.DEVNULL)
                    subprocess.run(["ip", "netns", "del", n.ns], check=False)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, stderr=subprocess.DEVNULL)
        os.close(self._host_ns)
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        left += [f"link {l.split(':')[1].strip()}" for l in links.splitlines() if self.prefix in l]
        if not left:
            subprocess.run(["rm", "-rf", str(self.dir)], check=False)
        return left
