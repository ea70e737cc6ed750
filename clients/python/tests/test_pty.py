"""grove/pty.py: a real terminal in a sandbox through the native API, sync and async."""

import time

import grove


def test_pty_sync(client):
    with grove.Sandbox.create(client=client) as s:
        seen = []
        t = s.pty.create(80, 24, on_data=seen.append)
        t.send_input("tty; stty size\n")
        deadline = time.time() + 10
        while b"24 80" not in bytes(t.output) and time.time() < deadline:
            time.sleep(0.05)
        t.resize(100, 30)
        t.send_input("stty size; exit 6\n")
        assert t.wait(30)["exit_code"] == 6
        out = bytes(t.output).decode(errors="replace")
        assert "/dev/pts/" in out and "24 80" in out and "30 100" in out, out
        assert b"".join(seen) == bytes(t.output)
        t = s.pty.create(cmd=["sleep", "100"], user="user")
        t.kill()
        assert t.wait(30)["signal"] == 9


async def test_pty_async(aclient):
    s = await grove.AsyncSandbox.create(client=aclient)
    try:
        t = await s.pty.create(40, 10, cmd="stty size; id -u", user="user")
        assert (await t.wait(30))["exit_code"] == 0
        out = bytes(t.output).decode(errors="replace")
        assert "10 40" in out and "1000" in out, out
    finally:
        await s.kill()
