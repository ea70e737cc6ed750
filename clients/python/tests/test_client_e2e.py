"""The client's features against a real groved, each scenario run through the sync and the asyncio client.

A scenario is written once with `await A(...)` around each call: for the sync client `A` passes the value
through (the call already ran), for the asyncio one it awaits it."""

import asyncio
import inspect
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import grove


async def A(v):
    return (await v) if inspect.isawaitable(v) else v


class Api:
    def __init__(self, asynchronous, client):
        self.asynchronous = asynchronous
        self.client = client
        p = "Async" if asynchronous else ""
        for name in ("Sandbox", "Snapshot", "Image", "Lease"):
            setattr(self, name, getattr(grove, p + name))

    async def create(self, **kw):
        return await A(self.Sandbox.create(client=self.client, **kw))

    async def kill(self, *sbxs):
        for s in sbxs:
            await A(s.kill())


@pytest.fixture(params=["sync", "async"])
async def api(request, groved):
    if request.param == "sync":
        c = grove.Client(socket=groved.socket)
        yield Api(False, c)
        c.close()
    else:
        c = grove.AsyncClient(socket=groved.socket)
        yield Api(True, c)
        await c.aclose()


async def test_files(api, tmp_path):
    sbx = await api.create(labels={"t": "files"})
    f = sbx.files
    try:
        assert await A(f.make_dir("/work/a/b")) is True
        assert await A(f.make_dir("/work/a/b")) is False
        assert (await A(f.stat("/work/a"))).type == "dir"
        await A(f.write("/work/a/b/x.txt", "hello"))
        st = await A(f.stat("/work/a/b/x.txt"))
        assert (st.type, st.size, st.path) == ("file", 5, "/work/a/b/x.txt")
        assert await A(f.exists("/work/a/b/x.txt")) and not await A(f.exists("/work/nope/x"))
        with pytest.raises(grove.NotFound) as e:
            await A(f.stat("/work/a/missing"))
        assert e.value.field == "path"
        await A(f.rename("/work/a/b/x.txt", "/work/a/y.txt"))
        assert not await A(f.exists("/work/a/b/x.txt")) and await A(f.read("/work/a/y.txt")) == "hello"
        with pytest.raises(grove.NotFound):
            await A(f.rename("/work/a/none", "/work/a/z"))
        await A(f.remove("/work/a"))
        assert not await A(f.exists("/work/a"))
        await A(f.remove("/work/a"))  # a missing path is fine
        with pytest.raises(grove.InvalidRequest):
            await A(f.remove("relative/path"))

        # Directories both ways; a tree with nesting, binary data and a mode.
        src = tmp_path / "src"
        (src / "d" / "e").mkdir(parents=True)
        (src / "top.txt").write_text("top")
        (src / "d" / "e" / "bin").write_bytes(bytes(range(256)) * 100)
        (src / "d" / "run.sh").write_text("#!/bin/sh\necho ran\n")
        os.chmod(src / "d" / "run.sh", 0o755)
        await A(f.upload_dir(str(src), "/up"))
        assert (await A(sbx.exec("/up/d/run.sh && cat /up/top.txt"))).stdout == "ran\ntop"
        out = tmp_path / "out"
        await A(f.download_dir("/up", str(out)))
        assert (out / "d" / "e" / "bin").read_bytes() == (src / "d" / "e" / "bin").read_bytes()
        assert (out / "top.txt").read_text() == "top" and os.access(out / "d" / "run.sh", os.X_OK)

        # A hostile tar from the sandbox cannot write outside the target directory.
        await A(sbx.exec("mkdir -p /evil && cd /evil && ln -s /etc link && echo x > ok"))
        evil_out = tmp_path / "evil"
        await A(f.download_dir("/evil", str(evil_out)))
        assert sorted(p.name for p in evil_out.iterdir()) == ["ok"]

        # watch: a change made by a background process shows up as events.
        await A(f.make_dir("/w"))
        await A(sbx.commands.start("sleep 1; echo new > /w/new.txt"))
        events = await A(f.watch("/w", timeout=20, interval=0.2))
        assert [(e.type, e.path) for e in events] == [("create", "/w/new.txt")]
        assert await A(f.watch("/w", timeout=0.5, interval=0.2)) == []
    finally:
        await api.kill(sbx)


async def test_background_process_handles(api):
    sbx = await api.create(labels={"t": "procs"})
    try:
        # A server started in the background keeps answering: its output goes to its log, not to a pipe.
        server = await A(sbx.commands.start(["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"],
                                            cwd="/etc"))
        assert server.pid > 0 and server.log_path
        fetch = ("import urllib.request, time\n"
                 "for i in range(300):\n"
                 "    try:\n"
                 "        print(len(urllib.request.urlopen('http://127.0.0.1:8000/hostname').read())); break\n"
                 "    except OSError: time.sleep(0.1)\n")
        await A(sbx.exec(["python3", "-c", fetch]))
        for _ in range(8):  # request after request answered: nothing blocks on a full pipe
            r = await A(sbx.exec(["python3", "-c", "import urllib.request as u; print(u.urlopen("
                                  "'http://127.0.0.1:8000/hostname').status)"]))
            assert r.stdout == "200\n", r.stderr
        assert "GET /hostname" in await A(server.log())
        again = await A(sbx.commands.connect(server.pid))
        assert again.running and again.pid == server.pid and "http.server" in " ".join(again.argv)
        assert server.pid in [p.pid for p in await A(sbx.commands.list())]
        await A(again.kill())
        await A(server.wait(timeout=10))
        assert not await A(server.is_running())
        with pytest.raises(grove.NotFound):
            await A(sbx.commands.connect(999999))

        seen = []
        job = await A(sbx.commands.run("echo one; sleep 1; echo two >&2", background=True))
        log = await A(job.wait(timeout=20, interval=0.2, on_output=seen.append))
        assert log == "one\ntwo\n" and "".join(seen) == log
        slow = await A(sbx.commands.start("sleep 30"))
        with pytest.raises(grove.RequestTimeout):
            await A(slow.wait(timeout=0.5))
        await A(slow.kill())
    finally:
        await api.kill(sbx)


def free_port():
    """A free port in the node's host port range (30000-32767)."""
    import random
    for _ in range(100):
        p = random.randint(30000, 32767)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port in 30000-32767")


async def test_snapshot_create_images_ports_batch_delete(api):
    tag = uuid.uuid4().hex[:6]
    src = await api.create(labels={"t": tag})
    try:
        await A(src.files.write("/root/state", "mid-task"))
        snap = await A(src.snapshot(name=f"py-{tag}"))
        assert snap.name in [s.name for s in await A(api.Snapshot.list(client=api.client))]
        forked = await api.create(snapshot=snap, labels={"t": tag, "kind": "fork"})
        assert await A(forked.files.read("/root/state")) == "mid-task"
        more = await A(api.Sandbox.create_many(2, labels={"t": tag}, client=api.client))
        assert "debian12" in [i.name for i in await A(api.Image.list(client=api.client))]
        gone = await A(api.Sandbox.delete_many(labels={"t": tag, "kind": "fork"}, client=api.client))
        assert gone == [forked.id]
        gone = await A(api.Sandbox.delete_many(labels={"t": tag}, client=api.client))
        assert sorted(gone) == sorted([src.id] + [m.id for m in more])
        assert await A(api.Sandbox.list(labels={"t": tag}, client=api.client)) == []
        exported = await A(snap.export())
        assert len(exported) > 0
        await A(snap.delete())
    finally:
        await api.kill(src)

    # A published port: groved maps it (the DNAT itself is tested in runtime/tests/network.rs, from a peer
    # netns: a node's published ports are for other hosts, not its own loopback).
    hp = free_port()
    sbx = await api.create(ports=[(hp, 8000)], network=["192.0.2.1/32"])  # ports need a network
    try:
        assert sbx.ports == [grove.Port(sandbox_port=8000, host_port=hp)]
        assert sbx.get_host(8000) == f"{socket.gethostname()}:{hp}"
        C = grove.AsyncClient if api.asynchronous else grove.Client
        far = C(base_url="http://10.1.2.3:7070")
        assert api.Sandbox(sbx.info.raw, far).get_host(8000) == f"10.1.2.3:{hp}"
        await A(far.aclose() if api.asynchronous else far.close())
    finally:
        await api.kill(sbx)


async def test_snapshot_lifetimes_and_batch_delete_by_job(api):
    """A tree search's leftovers go: a snapshot with its descendants in one call, a snapshot with a ttl once
    it expires and nothing needs it; a job's sandboxes in one call."""
    tag = uuid.uuid4().hex[:6]
    job = f"py-{tag}"
    root = await api.create(job=job)
    try:
        s1 = await A(root.snapshot(name=f"s1-{tag}"))
        [kid] = await A(s1.fork(1))
        s2 = await A(kid.snapshot(name=f"s2-{tag}"))
        assert s2.parent in (s1.name, s1.id)
        await api.kill(kid)
        assert sorted(await A(s1.delete(descendants=True))) == sorted([s1.name, s2.name])
        names = [s.name for s in await A(api.Snapshot.list(client=api.client))]
        assert s1.name not in names and s2.name not in names

        s3 = await A(root.snapshot(name=f"s3-{tag}", ttl=1))
        assert s3.expires_at_ms
        await asyncio.sleep(1.5)
        await A(api.Snapshot.gc(client=api.client))
        assert s3.name not in [s.name for s in await A(api.Snapshot.list(client=api.client))]

        more = await A(api.Sandbox.create_many(2, job=job, client=api.client))
        gone = await A(api.Sandbox.delete_many(job=job, client=api.client))
        assert sorted(gone) == sorted([root.id] + [m.id for m in more])
    finally:
        await api.kill(root)


async def test_lease_keeps_its_sandboxes_alive_then_deletes_them(api):
    if api.asynchronous:
        lease = api.Lease(api.client, ttl=4, heartbeat=0.5)
        async with lease:
            sbxs = [await A(lease.create())] + await A(lease.create_many(1))
            await asyncio.sleep(5)  # past the ttl: the heartbeat kept them
            assert all([await A(s.is_running()) for s in sbxs])
    else:
        with api.Lease(api.client, ttl=4, heartbeat=0.5) as lease:
            sbxs = [lease.create()] + lease.create_many(1)
            time.sleep(5)
            assert all(s.is_running() for s in sbxs)
    assert await A(api.Sandbox.list(labels={"grove.lease": lease.id}, client=api.client)) == []


async def test_exec_as_another_user(api):
    sbx = await api.create()
    try:
        r = await A(sbx.exec(["sh", "-c", "id -u; echo $HOME"], user="user"))
        assert (r.exit_code, r.stdout) == (0, "1000\n/home/user\n"), r
        assert (await A(sbx.exec(["id", "-u"], user="0"))).stdout == "0\n"
        with pytest.raises(grove.GroveError):
            await A(sbx.exec(["true"], user="nobody-here"))
    finally:
        await api.kill(sbx)


async def test_a_deadline_kills_the_command_in_the_sandbox(api):
    sbx = await api.create()
    try:
        r = await A(sbx.exec("sleep 30 && echo late", timeout=1))
        assert r.timed_out and r.stdout == ""
        left = await A(sbx.exec("ps -eo args | grep -c '^sleep 30' || true"))
        assert left.stdout.strip() == "0"
    finally:
        await api.kill(sbx)


async def test_a_cancelled_exec_ends_the_command_in_the_sandbox(aclient):
    """The client-side deadline of asyncio (wait_for, task cancel) closes the connection, and groved ends the
    command with it: nothing keeps running orphaned."""
    async with await grove.AsyncSandbox.create(client=aclient) as sbx:
        task = asyncio.ensure_future(sbx.exec("touch /tmp/started; sleep 31 && echo late > /tmp/late"))
        while not await sbx.files.exists("/tmp/started"):
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 10
        while (await sbx.exec("ps -eo args | grep -c '^sleep 31' || true")).stdout.strip() != "0":
            assert time.monotonic() < deadline, "the command outlived its cancelled request"
            await asyncio.sleep(0.2)


class Proxy:
    """A TCP proxy to groved that can cut every connection it carries."""

    def __init__(self, target):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(self.target)
            self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    def cut(self):
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.conns = []

    def close(self):
        self.cut()
        self.srv.close()


async def test_a_connection_killed_during_exec_runs_the_command_once(api, groved):
    sbx = await api.create()
    proxy = Proxy(groved.tcp)
    C = grove.AsyncClient if api.asynchronous else grove.Client
    via = C(base_url=proxy.url, api_key=groved.api_key)
    local = grove.Sandbox(sbx.info.raw, grove.Client(socket=groved.socket))

    def cut_once(path):
        def go():
            while not local.files.exists(path):
                time.sleep(0.05)
            proxy.cut()
        threading.Thread(target=go, daemon=True).start()

    try:
        far = await A(api.Sandbox.connect(sbx.id, client=via))
        # A plain exec carries an Idempotency-Key: its retry gets the first run's answer.
        cut_once("/tmp/runs")
        r = await A(far.exec("echo run >> /tmp/runs; sleep 2; echo done"))
        assert r.stdout == "done\n" and r.exit_code == 0
        assert (await A(sbx.files.read("/tmp/runs"))) == "run\n"  # once
        # A stream cannot be replayed: ConnectionLost, and groved ends the command with its client.
        cut_once("/tmp/streamed")
        with pytest.raises(grove.ConnectionLost) as e:
            await A(far.exec("echo run >> /tmp/streamed; sleep 2; echo late >> /tmp/streamed",
                             on_stdout=lambda s: None))
        assert "may have run" in str(e.value)
        await asyncio.sleep(3)
        assert (await A(sbx.files.read("/tmp/streamed"))) == "run\n"  # once, and ended
    finally:
        await A(via.aclose() if api.asynchronous else via.close())
        local._c.close()
        proxy.close()
        await api.kill(sbx)


TRAINER = textwrap.dedent("""
    import sys, time
    import grove
    c = grove.Client(socket=sys.argv[1])
    lease = grove.Lease(c, ttl=4, heartbeat=0.5, name=sys.argv[2])
    with lease:
        for _ in range(3):
            lease.create(labels={"rollout": "1"})
        print("ready", flush=True)
        time.sleep(600)
""")


PLAIN_TRAINER = textwrap.dedent("""
    import sys, time
    import grove
    c = grove.Client(socket=sys.argv[1])
    for _ in range(2):
        grove.Sandbox.create(labels={"run": sys.argv[2]}, client=c)   # no timeout: the node's default TTL
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_killed_trainers_plain_sandboxes_are_gone_after_the_nodes_default_ttl():
    """Without a lease or a timeout, the node's `default_ttl_secs` is what stops a crashed trainer's leak."""
    from conftest import Daemon
    d = Daemon("ttl", config="default_ttl_secs = 3")
    run = uuid.uuid4().hex[:8]
    env = dict(os.environ, PYTHONPATH=str(Path(grove.__file__).parents[1]))
    try:
        d.import_base_image()
        c = grove.Client(socket=d.socket)
        p = subprocess.Popen([sys.executable, "-c", PLAIN_TRAINER, d.socket, run], stdout=subprocess.PIPE, env=env)
        try:
            assert p.stdout.readline() == b"ready\n"
            sbxs = grove.Sandbox.list(labels={"run": run}, client=c)
            assert len(sbxs) == 2 and all(s.info.expires_at_ms for s in sbxs)
            p.kill()
            p.wait()
            killed = time.monotonic()
            while grove.Sandbox.list(labels={"run": run}, client=c):
                assert time.monotonic() - killed < 3 + 5, "a dead trainer's sandboxes outlived the default TTL"
                time.sleep(0.2)
            # timeout=0 opts out of the default: no expiry.
            with grove.Sandbox.create(timeout=0, client=c) as keep:
                assert keep.info.expires_at_ms is None
        finally:
            p.kill()
            p.wait()
            c.close()
    finally:
        d.stop()


def test_a_killed_trainers_sandboxes_are_gone_after_the_ttl(groved, client):
    name = f"lease-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=str(Path(grove.__file__).parents[1]))
    p = subprocess.Popen([sys.executable, "-c", TRAINER, groved.socket, name], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline() == b"ready\n"
        time.sleep(5)  # past the ttl while alive: its heartbeat holds them
        assert len(grove.Sandbox.list(labels={"grove.lease": name}, client=client)) == 3
        p.kill()  # mid-rollout, no cleanup
        p.wait()
        killed = time.monotonic()
        while grove.Sandbox.list(labels={"grove.lease": name}, client=client):
            assert time.monotonic() - killed < 4 + 5, "a dead trainer's sandboxes outlived their ttl"
            time.sleep(0.2)
    finally:
        p.kill()
        p.wait()
        grove.Sandbox.delete_many(labels={"grove.lease": name}, client=client)


async def test_queue_timeout_on_a_full_node():
    """A full node answers CapacityExceeded within the call's queue_timeout (not after retries of the node's
    own queue wait), sync and async; 0 answers at once."""
    from conftest import Daemon
    d = Daemon("full", capacity_sandboxes=1)
    try:
        d.import_base_image()
        sync, asy = grove.Client(socket=d.socket), grove.AsyncClient(socket=d.socket)
        held = grove.Sandbox.create(client=sync)
        try:
            for qt, most in ((0, 1.0), (1, 3.0)):
                t = time.monotonic()
                with pytest.raises(grove.CapacityExceeded):
                    grove.Sandbox.create(client=sync, queue_timeout=qt)
                assert time.monotonic() - t < most, qt
                t = time.monotonic()
                with pytest.raises(grove.CapacityExceeded):
                    await grove.AsyncSandbox.create(client=asy, queue_timeout=qt)
                assert time.monotonic() - t < most, qt
        finally:
            held.kill()
            sync.close()
            await asy.aclose()
    finally:
        d.stop()
