"""Starts a real groved for the tests: its own temp state/run dirs and cgroup root (never the node's defaults),
the base image imported once, and on teardown SIGTERM, a clean exit and zero residue asserted.

The binaries come from GROVED_BIN / GROVE_INIT_BINARY, else <repo>/target/debug/{groved,grove-init}."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]
BASE_IMAGE_DIR = "/var/lib/grove/images/debian12"
IMAGE = "debian12"
# Each sandbox's default disk quota. Admission counts every quota against the disk's free space (less
# what sandboxes already wrote), so the 40 sandboxes of the e2e test need 40 × this free: kept small.
DEFAULT_DISK_MB = 128


def binary(env: str, name: str) -> Path:
    p = Path(os.environ.get(env) or REPO / "target" / "debug" / name)
    if not p.exists():
        pytest.exit(f"{p} not found: build with `cargo build -p groved -p grove-runtime` or set {env}", returncode=2)
    return p


class Daemon:
    def __init__(self, tag: str, capacity_sandboxes: int = 64, tcp: bool = False, config: str = "",
                 extra_config: str = "", e2b: bool = False):
        """`config`, `extra_config`: more top-level groved.toml lines (e.g. `default_ttl_secs = 3`)."""
        self.dir = Path(f"/tmp/grove-pytest-{tag}-{uuid.uuid4().hex[:8]}")
        (self.dir / "state").mkdir(parents=True)
        (self.dir / "run").mkdir(parents=True)
        self.socket = str(self.dir / "run" / "groved.sock")
        self.cgroup_root = f"grove-py{uuid.uuid4().hex[:8]}"
        self.api_key = uuid.uuid4().hex
        (self.dir / "api-key").write_text(self.api_key)
        self.tcp = None
        listen = ""
        if tcp:
            import socket as so
            with so.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.tcp = f"127.0.0.1:{s.getsockname()[1]}"
            listen = f'listen = ["{self.tcp}"]\napi_key_file = "{self.dir}/api-key"'
        self.e2b = None
        if e2b:  # the E2B-compatible endpoint (tests/e2b_node.py)
            import socket as so
            with so.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.e2b = f"127.0.0.1:{s.getsockname()[1]}"
            listen += f'\ne2b_listen = "{self.e2b}"' + ("" if tcp else f'\napi_key_file = "{self.dir}/api-key"')
        (self.dir / "groved.toml").write_text(f"""
state_dir = "{self.dir}/state"
run_dir = "{self.dir}/run"
socket = "{self.socket}"
{listen}
{config}
{extra_config}
root_provider = "nodefs"
cgroup_root = "{self.cgroup_root}"
reap_interval_ms = 200
net_pool = "10.214.0.0/16"
[capacity]
memory_mb = 16384
memory_reserve_mb = 0
sandboxes = {capacity_sandboxes}
[defaults]
cpu_millis = 250
memory_mb = 128
pids = 256
open_files = 1024
disk_mb = {DEFAULT_DISK_MB}
""")
        env = dict(os.environ, GROVE_INIT_BINARY=str(binary("GROVE_INIT_BINARY", "grove-init")), GROVE_LOG="info")
        self.log = open(self.dir / "groved.log", "w")
        self.proc = subprocess.Popen([str(binary("GROVED_BIN", "groved")), "--config", str(self.dir / "groved.toml")],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env)
        deadline = time.time() + 30
        while True:
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://g") as c:
                    if c.get("/v1/health").status_code == 200:
                        break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop(check=False)
                raise RuntimeError(f"groved did not start:\n{self.log_text()}")
            time.sleep(0.05)

    def log_text(self) -> str:
        try:
            return (self.dir / "groved.log").read_text()[-5000:]
        except OSError:
            return ""

    def http(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://g", timeout=120)

    def import_base_image(self) -> None:
        with self.http() as c:
            r = c.post("/v1/images", json={"name": IMAGE, "source": "dir", "path": BASE_IMAGE_DIR})
            assert r.status_code == 201, r.text

    def residue(self) -> dict:
        with self.http() as c:
            return c.get("/v1/node/residue").json()

    def leftovers(self) -> list:
        out = []
        d = str(self.dir)
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            if d in line:
                out.append(f"mount {line}")
        for ctrl in Path("/sys/fs/cgroup").iterdir():
            root = ctrl / self.cgroup_root
            if root.is_dir():
                out += [f"cgroup {p}" for p in root.iterdir() if p.is_dir()]
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                if (p / "comm").read_text().strip() == "grove-init" and os.readlink(p / "root").startswith(d):
                    out.append(f"process {p.name}")
            except OSError:
                pass
        return out

    def stop(self, check: bool = True) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                if check:
                    raise AssertionError(f"groved did not stop on SIGTERM:\n{self.log_text()}")
        self.log.close()
        left = self.leftovers()
        code = self.proc.returncode
        if check and (code != 0 or left):
            raise AssertionError(f"groved exit {code}, leftovers {left}; kept {self.dir}\n{self.log_text()}")
        if not left:
            subprocess.run(["rm", "-rf", str(self.dir)], check=False)


@pytest.fixture(scope="session")
def groved():
    d = Daemon("main", tcp=True)
    d.import_base_image()
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def _no_sandbox_outlives_its_test(request):
    """A test that fails half-way leaves sandboxes on the session's daemon; they are killed here, so one
    failure does not turn into the next tests' (their quotas would hold the disk, their labels the lists)."""
    yield
    if "groved" not in request.fixturenames:
        return
    d = request.getfixturevalue("groved")
    with d.http() as c:
        for _ in range(100):  # pages of the list, each emptied
            items = c.get("/v1/sandboxes").json()["items"]
            if not items:
                return
            for s in items:
                c.delete(f"/v1/sandboxes/{s['id']}")


@pytest.fixture
def client(groved):
    import grove
    c = grove.Client(socket=groved.socket)
    yield c
    c.close()


@pytest.fixture
async def aclient(groved):
    import grove
    c = grove.AsyncClient(socket=groved.socket)
    yield c
    await c.aclose()


from e2b_node import e2b_env, e2b_node  # noqa: E402,F401  (the E2B endpoint's daemon, shared by test_e2b_*.py)
