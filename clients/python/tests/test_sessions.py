"""Shell sessions through the Python client (sync and async) against a real groved: state carries,
a timeout spares the session, a dead shell is an error naming it, and a fork carries the session."""

import asyncio

import pytest

import grove


def test_session_state_carries_sync(client):
    with grove.Sandbox.create(memory_mb=128, timeout=300, client=client) as sbx:
        main = sbx.sessions.create("main")
        assert main.name == "main" and main.info["alive"]
        assert main.run("mkdir -p /src && cd /src && export V=1 && f() { echo f$1; }").ok
        r = main.run("pwd; echo $V; f x; printf 'no newline'")
        assert (r.output, r.exit_code) == ("/src\n1\nfx\nno newline", 0)
        assert main.run("cat", input="piped").output == "piped"
        r = main.run("sleep 50", timeout=0.3)
        assert r.timed_out and r.session_alive and r.exit_code == 130
        assert main.run("echo $V").output == "1\n"
        assert [s.name for s in sbx.sessions.list()] == ["main"]
        with pytest.raises(grove.NotFound):
            sbx.sessions.get("nope").run("true")
        r = main.run("exit 5")
        assert not r.session_alive and r.exit_code == 5
        with pytest.raises(grove.Conflict) as e:
            main.run("true")
        assert "main" in str(e.value)
        assert not main.is_alive()
        main.close()
        assert sbx.sessions.list() == []


async def test_session_async_and_fork(aclient):
    sbx = await grove.AsyncSandbox.create(memory_mb=128, timeout=300, client=aclient)
    try:
        s = await sbx.sessions.create("agent", cwd="/tmp")
        await s.run("export STEP=snap; mkdir -p /w && cd /w; sleep 300 &")
        snap = await sbx.snapshot()
        branches = await snap.fork(2)
        try:
            outs = await asyncio.gather(*[(await b.sessions.get("agent")).run("pwd; echo $STEP; jobs | wc -l")
                                          for b in branches])
            assert [o.output for o in outs] == ["/w\nsnap\n1\n"] * 2
            for i, b in enumerate(branches):
                await (await b.sessions.get("agent")).run(f"export STEP=b{i}")
            got = [(await (await b.sessions.get("agent")).run("echo $STEP")).output for b in branches]
            assert got == ["b0\n", "b1\n"]
            assert (await s.run("echo $STEP")).output == "snap\n"
        finally:
            await asyncio.gather(*[b.kill() for b in branches])
            await snap.delete()
    finally:
        await sbx.kill()


def test_session_figures_fork_8_all_answer(client):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "session_figures.py"
    spec = importlib.util.spec_from_file_location("session_figures", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = mod.figures(runs=20, branches=8, client=client)
    print("session figures:", f)
    assert f["sessions_answering"] == 8, f
