"""The sync client against a real groved."""

import io
import tarfile

import pytest

import grove


def test_sandbox_basics(client):
    with grove.Sandbox.create(cpu=0.5, memory_mb=128, timeout=300, env={"A": "1"}, labels={"t": "sync"},
                              job="pytest-sync", client=client) as sbx:
        assert sbx.id.startswith("sb-") and sbx.info.state == "running"
        assert sbx.info.job == "pytest-sync"
        r = sbx.exec("echo $A; echo e >&2; exit 4")
        assert (r.stdout, r.stderr, r.exit_code, r.ok) == ("1\n", "e\n", 4, False)
        assert sbx.commands.run(["printf", "%s", "héllo"]).stdout == "héllo"
        assert sbx.exec("cat", stdin=b"\x00\x01").stdout_bytes == b"\x00\x01"
        assert sbx.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
        r = sbx.exec("sleep 20", timeout=0.5)
        assert r.timed_out and not r.ok
        got = []
        r = sbx.exec("echo a; echo b", on_stdout=got.append)
        assert "".join(got) == "a\nb\n" and r.exit_code == 0 and r.stdout == "a\nb\n"

        sbx.files.write("/tmp/x.txt", "data", mode=0o640)
        assert sbx.files.read("/tmp/x.txt") == "data"
        assert sbx.files.read("/tmp/x.txt", format="bytes") == b"data"
        e = [e for e in sbx.files.list("/tmp") if e.name == "x.txt"][0]
        assert (e.type, e.size, e.mode & 0o777, e.path) == ("file", 4, 0o640, "/tmp/x.txt")
        assert sbx.files.exists("/tmp/x.txt") and not sbx.files.exists("/tmp/nope")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            info = tarfile.TarInfo("d/f.txt")
            info.size = 2
            t.addfile(info, io.BytesIO(b"hi"))
        sbx.files.upload_tar("/work", buf.getvalue())
        assert sbx.exec("cat /work/d/f.txt").stdout == "hi"
        names = tarfile.open(fileobj=io.BytesIO(sbx.files.download_tar("/work/d"))).getnames()
        assert any(n.endswith("f.txt") for n in names)

        proc = sbx.commands.run("sleep 100", background=True)
        assert any(p.pid == proc.pid and p.running for p in sbx.commands.list())
        sbx.commands.kill(proc.pid)

        sbx.pause()
        assert sbx.info.state == "paused"
        with pytest.raises(grove.Conflict):
            sbx.pause()
        sbx.resume()
        assert sbx.exec("echo ok").stdout == "ok\n"
        sbx.pause()
        assert sbx.exec("echo transparent").stdout == "transparent\n"  # the next call resumes it
        assert sbx.refresh().state == "running"
        sbx.set_timeout(60)
        assert sbx.info.expires_at_ms is not None
        assert sbx.usage()["pids"] >= 1
        assert any(s.id == sbx.id for s in grove.Sandbox.list(labels={"t": "sync"}, client=client))
        sid = sbx.id
    # the context manager killed it
    with pytest.raises(grove.NotFound):
        grove.Sandbox.connect(sid, client=client)
    with pytest.raises(grove.NotFound):
        sbx.exec("true")
    sbx.kill()  # idempotent


def test_errors_are_typed_and_name_the_field(client):
    with pytest.raises(grove.NotFound) as e:
        grove.Sandbox.create(image="no-such-image", client=client)
    assert e.value.field == "image"
    with pytest.raises(grove.InvalidRequest) as e:
        grove.Sandbox.create(memory_mb=0, client=client)
    assert e.value.field == "memory_mb" and e.value.status is None  # refused before anything was sent
    with pytest.raises(grove.InvalidRequest) as e:
        grove.Sandbox.create(network=["10.0.0.0/99"], client=client)
    assert "cidr" in e.value.field and e.value.status == 422
    with grove.Sandbox.create(client=client) as sbx:
        with pytest.raises(grove.InvalidRequest) as e:
            sbx.files.read("/etc/../../x")
        assert e.value.field == "path"


def test_create_many_and_list(client):
    sbxs = grove.Sandbox.create_many(3, labels={"t": "many"}, client=client)
    try:
        assert len({s.id for s in sbxs}) == 3
        assert {s.id for s in grove.Sandbox.list(labels={"t": "many"}, client=client)} == {s.id for s in sbxs}
    finally:
        for s in sbxs:
            s.kill()


def test_tcp_with_api_key(groved):
    with grove.Client(base_url=f"http://{groved.tcp}", api_key=groved.api_key) as c:
        with grove.Sandbox.create(client=c) as sbx:
            assert sbx.exec(["echo", "over tcp"]).stdout == "over tcp\n"
    with grove.Client(base_url=f"http://{groved.tcp}", api_key="wrong") as c:
        with pytest.raises(grove.Unauthorized):
            grove.Sandbox.list(client=c)
