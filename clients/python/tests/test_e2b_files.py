"""The E2B filesystem (Connect `filesystem.Filesystem` and the /files routes) through the
unmodified `e2b` SDK, sync and async; and the access token that guards a sandbox's traffic."""

from __future__ import annotations

import time

import httpx
import pytest

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox, FileType, Sandbox  # noqa: E402
from e2b.exceptions import InvalidArgumentException, NotFoundException  # noqa: E402


@pytest.fixture
def sbx(e2b_env):
    s = Sandbox.create(timeout=120)
    yield s
    s.kill()


def test_write_read_text_bytes_and_many(sbx):
    sbx.files.write("/tmp/t.txt", "hello ✓")
    assert sbx.files.read("/tmp/t.txt") == "hello ✓"
    blob = bytes(range(256)) * 1000
    sbx.files.write("/tmp/deep/er/b.bin", blob)
    assert sbx.files.read("/tmp/deep/er/b.bin", format="bytes") == blob
    infos = sbx.files.write_files([
        {"path": "/tmp/m/one.txt", "data": "1"},
        {"path": "/tmp/m/two.txt", "data": b"2"},
    ])
    assert sorted(i.path for i in infos) == ["/tmp/m/one.txt", "/tmp/m/two.txt"]
    assert sbx.files.read("/tmp/m/two.txt") == "2"
    # Relative paths are under the user's home; `root`'s is /root.
    sbx.files.write("rel.txt", "in home")
    assert sbx.files.read("/home/user/rel.txt") == "in home"
    assert sbx.files.get_info("/home/user/rel.txt").owner in ("user", "1000")
    sbx.files.write("r.txt", "root's", user="root")
    assert sbx.files.read("/root/r.txt") == "root's"
    assert sbx.files.get_info("/root/r.txt").owner == "root"
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/missing.txt")


def test_list_exists_info_make_dir_rename_remove(sbx):
    assert sbx.files.make_dir("/tmp/d/sub") is True
    assert sbx.files.make_dir("/tmp/d/sub") is False
    sbx.files.write("/tmp/d/a.txt", "abc")
    sbx.files.write("/tmp/d/sub/b.txt", "b")
    names = sorted(e.name for e in sbx.files.list("/tmp/d"))
    assert names == ["a.txt", "sub"]
    deep = sorted(e.path for e in sbx.files.list("/tmp/d", depth=2))
    assert deep == ["/tmp/d/a.txt", "/tmp/d/sub", "/tmp/d/sub/b.txt"]
    info = sbx.files.get_info("/tmp/d/a.txt")
    assert (info.name, info.type, info.size) == ("a.txt", FileType.FILE, 3)
    assert sbx.files.get_info("/tmp/d").type == FileType.DIR
    assert sbx.files.exists("/tmp/d/a.txt") and not sbx.files.exists("/tmp/d/nope")
    moved = sbx.files.rename("/tmp/d/a.txt", "/tmp/d/c.txt")
    assert moved.path == "/tmp/d/c.txt"
    assert not sbx.files.exists("/tmp/d/a.txt") and sbx.files.read("/tmp/d/c.txt") == "abc"
    sbx.files.remove("/tmp/d")
    assert not sbx.files.exists("/tmp/d")
    with pytest.raises(NotFoundException):
        sbx.files.list("/tmp/d")


def _plant_symlink(node, sandbox_id: str, name: str, target: str) -> None:
    """Puts a symlink into the sandbox through Grove's own archive upload (as a process inside
    could make one)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo(name)
        info.type = tarfile.SYMTYPE
        info.linkname = target
        t.addfile(info)
    with node.http() as c:
        r = c.put(f"/v1/sandboxes/{sandbox_id}/archive", params={"path": "/tmp"}, content=buf.getvalue())
        assert r.status_code == 204, r.text


def test_paths_and_symlinks_cannot_leave_the_sandbox(sbx, e2b_env, tmp_path):
    host_dir = tmp_path / "host"
    host_dir.mkdir()
    marker = host_dir / "secret.txt"
    marker.write_text("host secret")
    # A link to the host's directory, and one to the host's root, planted inside the sandbox.
    _plant_symlink(e2b_env, sbx.sandbox_id, "hostdir", str(host_dir))
    _plant_symlink(e2b_env, sbx.sandbox_id, "root", "/")
    for p in [f"/tmp/hostdir/secret.txt", f"/tmp/root{marker}", str(marker)]:
        with pytest.raises(NotFoundException) as err:
            sbx.files.read(p)
        assert "host secret" not in str(err.value)
        assert not sbx.files.exists(p)
    for op in (sbx.files.read, sbx.files.exists, sbx.files.list):
        with pytest.raises(InvalidArgumentException):
            op(f"../../../..{marker}")
    # Writes, mkdirs, renames and removes through the links stay inside the sandbox too.
    sbx.files.write(f"/tmp/root{host_dir}/planted.txt", "from the sandbox")
    sbx.files.make_dir(f"/tmp/root{host_dir}/planted-dir")
    with pytest.raises(Exception):
        sbx.files.rename(f"/tmp/root{marker}", "/tmp/stolen.txt")
    with pytest.raises(Exception):
        sbx.files.remove(f"/tmp/root{marker}")
    sbx.files.remove("/tmp/hostdir")  # removes the link itself, never what it points at
    assert marker.read_text() == "host secret"
    assert sorted(p.name for p in host_dir.iterdir()) == ["secret.txt"]
    assert sbx.files.get_info("/tmp/root").type.name == "DIR" or sbx.files.get_info("/tmp/root").symlink_target == "/"


def test_watch_dir_sync(sbx):
    sbx.files.make_dir("/tmp/w")
    h = sbx.files.watch_dir("/tmp/w")
    try:
        sbx.files.write("/tmp/w/new.txt", "data")
        sbx.files.remove("/tmp/w/new.txt")
        events = h.get_new_events()
        kinds = {(e.name, e.type.name) for e in events}
        assert ("new.txt", "CREATE") in kinds or ("new.txt", "REMOVE") in kinds or events == []
        sbx.files.write("/tmp/w/again.txt", "x")
        got = h.get_new_events()
        assert ("again.txt", "CREATE") in {(e.name, e.type.name) for e in got}
    finally:
        h.stop()


def test_secure_sandbox_needs_its_access_token(sbx, e2b_env):
    url = f"http://{e2b_env.e2b}/files?path=/etc/hostname&username=root"
    hdr = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    assert httpx.get(url, headers=hdr).status_code == 401
    assert httpx.get(url, headers={**hdr, "X-Access-Token": "guess"}).status_code == 401
    token = Sandbox.get_info(sbx.sandbox_id)  # noqa: F841 (the SDK holds the token, not the test)
    rpc = f"http://{e2b_env.e2b}/filesystem.Filesystem/Stat"
    r = httpx.post(rpc, json={"path": "/etc"}, headers={**hdr, "Content-Type": "application/json"})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"


async def test_async_files_and_watch(e2b_env):
    sbx = await AsyncSandbox.create(timeout=120)
    try:
        await sbx.files.write("/tmp/x.txt", "async text")
        assert await sbx.files.read("/tmp/x.txt") == "async text"
        await sbx.files.make_dir("/tmp/aw")
        seen = []
        handle = await sbx.files.watch_dir("/tmp/aw", on_event=lambda e: seen.append((e.name, e.type.name)))
        await sbx.files.write("/tmp/aw/f.txt", "1")
        deadline = time.time() + 5
        while ("f.txt", "CREATE") not in seen and time.time() < deadline:
            import asyncio
            await asyncio.sleep(0.05)
        await handle.stop()
        assert ("f.txt", "CREATE") in seen
        entries = await sbx.files.list("/tmp")
        assert "x.txt" in [e.name for e in entries]
        assert await sbx.files.exists("/tmp/x.txt")
        await sbx.files.remove("/tmp/x.txt")
        assert not await sbx.files.exists("/tmp/x.txt")
    finally:
        await sbx.kill()


def test_connect_json_codec_unary_and_streaming(sbx, e2b_env):
    """The SDK speaks protobuf; Connect's JSON codec works too, unary and server-streaming."""
    import json
    import struct

    # The token as E2B's REST detail hands it out (it is stored nowhere: a keyed hash of the id).
    token = httpx.get(f"http://{e2b_env.e2b}/sandboxes/{sbx.sandbox_id}",
                      headers={"X-API-Key": e2b_env.api_key}).json()["envdAccessToken"]
    base = f"http://{e2b_env.e2b}/filesystem.Filesystem"
    hdr = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token}
    r = httpx.post(f"{base}/Stat", json={"path": "/etc"}, headers={**hdr, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    r = httpx.post(f"{base}/Stat", json={"path": "/nope"}, headers={**hdr, "Content-Type": "application/json"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = httpx.post(f"{base}/Stat", content=b"{bad", headers={**hdr, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
    # Server streaming: one enveloped request; the stream of a missing directory ends with an
    # end-of-stream message carrying the error.
    msg = json.dumps({"path": "/nope"}).encode()
    body = struct.pack(">BI", 0, len(msg)) + msg
    r = httpx.post(f"{base}/WatchDir", content=body, headers={**hdr, "Content-Type": "application/connect+json"})
    assert r.status_code == 200
    flags, n = struct.unpack(">BI", r.content[:5])
    assert flags == 2 and json.loads(r.content[5:5 + n])["error"]["code"] == "not_found"
