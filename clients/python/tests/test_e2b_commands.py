"""E2B's `commands` and `pty` through the unmodified `e2b` SDK (its public API only) against a real groved's
E2B endpoint: run, streaming callbacks, background + wait, stdin, kill, envs, cwd, users, timeouts, non-zero
exits raising the SDK's CommandExitException, connect, PTY; the sync and the async SDK classes."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox, CommandExitException, Sandbox, TimeoutException  # noqa: E402
from e2b.sandbox.commands.command_handle import PtySize  # noqa: E402

from conftest import IMAGE, Daemon  # noqa: E402


@pytest.fixture(scope="module")
def e2b_node(monkeypatch_module):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    d = Daemon("e2bcmd", extra_config=f'e2b_listen = "{addr}"')
    d.import_base_image()
    monkeypatch_module.setenv("E2B_API_URL", f"http://{addr}")
    monkeypatch_module.setenv("E2B_SANDBOX_URL", f"http://{addr}")
    monkeypatch_module.setenv("E2B_API_KEY", "e2b_any")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def sbx(e2b_node):
    s = Sandbox.create(template=IMAGE, timeout=600)
    yield s
    s.kill()


def kept(s: Sandbox, needle: str) -> bool:
    return any(needle in " ".join([p.cmd] + list(p.args)) for p in s.commands.list())


def test_run_envs_cwd_user_and_streaming(sbx):
    r = sbx.commands.run("echo $FOO; pwd; whoami", envs={"FOO": "bar"}, cwd="/tmp")
    assert (r.exit_code, r.stdout) == (0, "bar\n/tmp\nuser\n")
    assert sbx.commands.run("pwd").stdout == "/home/user\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"
    out, err = [], []
    r = sbx.commands.run("for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.05; done",
                         on_stdout=out.append, on_stderr=err.append)
    assert "".join(out) == "o1\no2\no3\n" and "".join(err) == "e1\ne2\ne3\n"
    assert r.stdout == "o1\no2\no3\n"


def test_nonzero_exit_raises_and_user_cannot_read_root_files(sbx):
    sbx.commands.run("echo s3cret > /root/secret && chmod 600 /root/secret", user="root")
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo nope >&2; exit 3")
    assert (e.value.exit_code, e.value.stderr) == (3, "nope\n")
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("cat /root/secret")
    assert "Permission denied" in e.value.stderr and "s3cret" not in e.value.stdout


def test_background_wait_stdin_kill_connect(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "hello\n"

    h = sbx.commands.run("sleep 300", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert sbx.commands.kill(h.pid) is False

    # timeout=0: a process that outlives its client; connect replays what it wrote.
    h = sbx.commands.run("echo a; sleep 0.5; echo b", background=True, timeout=0)
    h.disconnect()
    r = sbx.commands.connect(h.pid).wait()
    assert r.stdout == "a\nb\n"


def test_timeout_and_a_dropped_stream_leave_no_process(sbx):
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 123", timeout=1)
    time.sleep(0.5)
    assert not kept(sbx, "sleep 123")
    h = sbx.commands.run("sleep 124", background=True, timeout=30)
    h.disconnect()
    deadline = time.time() + 5
    while kept(sbx, "sleep 124") and time.time() < deadline:
        time.sleep(0.1)
    assert not kept(sbx, "sleep 124")


def test_pty(sbx):
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.send_stdin(h.pid, b"tty; stty size\n")
    chunks = []
    for _, _, pty in h:  # the first size is printed before the resize
        chunks.append(pty or b"")
        if b"24 80" in b"".join(chunks):
            break
    sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(h.pid, b"stty size; exit 4\n")
    with pytest.raises(CommandExitException) as e:
        h.wait(on_pty=chunks.append)
    out = b"".join(chunks).decode(errors="replace")
    assert e.value.exit_code == 4
    assert "/dev/pts/" in out and "24 80" in out and "30 100" in out, out
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    assert sbx.pty.kill(h.pid) is True


def test_async_sdk(e2b_node):
    async def main():
        s = await AsyncSandbox.create(template=IMAGE, timeout=300)
        try:
            r = await s.commands.run("echo $X; pwd", envs={"X": "y"}, cwd="/etc")
            assert r.stdout == "y\n/etc\n"
            with pytest.raises(CommandExitException):
                await s.commands.run("exit 9")
            h = await s.commands.run("cat", background=True, stdin=True)
            await s.commands.send_stdin(h.pid, "in\n")
            await s.commands.close_stdin(h.pid)
            assert (await h.wait()).stdout == "in\n"
            with pytest.raises(TimeoutException):
                await s.commands.run("sleep 50", timeout=1)
            seen = []
            p = await s.pty.create(PtySize(rows=10, cols=40), on_data=seen.append)
            await s.pty.send_stdin(p.pid, b"stty size; exit\n")
            await p.wait()
            assert "10 40" in b"".join(seen).decode(errors="replace")
        finally:
            await s.kill()
    asyncio.run(main())
