"""What costs wall time: a command of two minutes with no timeout (sync and async at once, ONE test), and file
transfers of 50 and 200 MiB timed against curl on the same socket in the same run."""

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import grove


@pytest.mark.long
async def test_a_two_minute_command_without_timeout(groved):
    """No hidden cap: the clients' default timeout for short calls is 60 s, and a command outlives it."""
    sync = grove.Client(socket=groved.socket)
    asy = grove.AsyncClient(socket=groved.socket)
    a = await grove.AsyncSandbox.create(client=asy)
    s = grove.Sandbox.create(client=sync)
    try:
        t = time.monotonic()
        cmd = "sleep 125; echo done"
        ra, rs = await asyncio.gather(a.exec(cmd), asyncio.to_thread(s.exec, cmd))
        took = time.monotonic() - t
        assert (ra.stdout, ra.exit_code) == ("done\n", 0) and (rs.stdout, rs.exit_code) == ("done\n", 0)
        assert took >= 125
    finally:
        await a.kill()
        s.kill()
        await asy.aclose()
        sync.close()


def curl_put(groved, sbx_id, path, src):
    t = time.monotonic()
    subprocess.run(["curl", "-sf", "--unix-socket", groved.socket, "-T", src, "-H",
                    "content-type: application/octet-stream",
                    f"http://g/v1/sandboxes/{sbx_id}/files?path={path}"], check=True)
    return time.monotonic() - t


def curl_get(groved, sbx_id, path, dst):
    t = time.monotonic()
    subprocess.run(["curl", "-sf", "--unix-socket", groved.socket, "-o", dst,
                    f"http://g/v1/sandboxes/{sbx_id}/files?path={path}"], check=True)
    return time.monotonic() - t


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is needed as the yardstick")
@pytest.mark.parametrize("mib", [50, 200])
async def test_transfers_stream_about_as_fast_as_curl(groved, mib):
    # In memory (/dev/shm), so the host disk's writeback stalls do not decide the race.
    tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        await transfers(groved, tmp_path, mib)
    finally:
        shutil.rmtree(tmp_path)


async def transfers(groved, tmp_path, mib):
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.write(os.urandom(1 << 20) * mib)
    size = src.stat().st_size
    sync = grove.Client(socket=groved.socket)
    asy = grove.AsyncClient(socket=groved.socket)
    sbx = grove.Sandbox.create(disk_mb=512, client=sync)  # room for the one file, overwritten
    asbx = await grove.AsyncSandbox.connect(sbx.id, client=asy)
    times = {k: [] for k in ("curl_up", "up", "async_up", "curl_down", "down", "async_down")}

    def timed(key, fn, *a, **kw):
        t = time.monotonic()
        out = fn(*a, **kw)
        times[key].append(time.monotonic() - t)
        return out

    async def atimed(key, coro):
        t = time.monotonic()
        await coro
        times[key].append(time.monotonic() - t)

    try:
        # Interleaved rounds, best of each: the box is shared, so a stall hits whoever runs at that moment.
        # Every client writes the same path and reads the same file: the server does the same work for each.
        # A round where curl lands on an idle moment and ours on a busy one (CI runs the long suite
        # beside this one) earns more rounds, up to a limit: the bar itself stays the same.
        pairs = (("up", "curl_up"), ("async_up", "curl_up"), ("down", "curl_down"),
                 ("async_down", "curl_down"))

        def missed():
            best = {k: min(v) for k, v in times.items()}
            return [ours for ours, theirs in pairs if best[ours] > 1.5 * best[theirs] + 0.25]

        rounds = 0
        while rounds < (4 if mib <= 50 else 3) or (rounds < 8 and missed()):
            rounds += 1
            seen = []
            timed("curl_up", curl_put, groved, sbx.id, "/root/up", str(src))
            timed("up", sbx.files.upload, str(src), "/root/up", on_progress=lambda d, n: seen.append((d, n)))
            await atimed("async_up", asbx.files.upload(str(src), "/root/up"))
            assert seen[-1] == (size, size) and len(seen) >= mib
            timed("curl_down", curl_get, groved, sbx.id, "/root/up", str(tmp_path / "c"))
            timed("down", sbx.files.download, "/root/up", str(tmp_path / "s"))
            await atimed("async_down", asbx.files.download("/root/up", str(tmp_path / "a")))
        for name in ("c", "s", "a"):
            assert (tmp_path / name).stat().st_size == size
        assert (tmp_path / "a").read_bytes() == src.read_bytes() == (tmp_path / "s").read_bytes()
        best = {k: min(v) for k, v in times.items()}
        print(f"{mib} MiB, {rounds} rounds: " + ", ".join(f"{k} {v:.2f}s" for k, v in best.items()))
        # The goal is 1.5x curl; a little absolute slack for a loaded 2-core box.
        for ours, theirs in pairs:
            assert best[ours] <= 1.5 * best[theirs] + 0.25, (ours, times)
    finally:
        sbx.kill()
        await asy.aclose()
        sync.close()
