"""The asyncio client beyond the e2e test: streaming, files, processes, pause/resume, typed errors."""

import pytest

import grove


async def test_async_sandbox_api(aclient):
    async with await grove.AsyncSandbox.create(memory_mb=128, labels={"t": "async"}, client=aclient) as sbx:
        got = []
        r = await sbx.exec("for i in 1 2; do echo $i; done; exit 2", on_stdout=got.append)
        assert (r.exit_code, "".join(got), r.stdout) == (2, "1\n2\n", "1\n2\n")
        assert (await sbx.commands.run(["cat"], stdin="in")).stdout == "in"
        await sbx.files.write("/tmp/a", b"\x01\x02")
        assert await sbx.files.read("/tmp/a", format="bytes") == b"\x01\x02"
        assert [e.name for e in await sbx.files.list("/tmp") if e.name == "a"] == ["a"]
        proc = await sbx.commands.run("sleep 60", background=True)
        assert any(p.pid == proc.pid for p in await sbx.commands.list())
        await proc.kill()
        await sbx.pause()
        with pytest.raises(grove.Conflict):
            await sbx.pause()
        await sbx.resume()
        await sbx.pause()
        assert (await sbx.exec("echo transparent")).stdout == "transparent\n"  # the next call resumes it
        assert (await sbx.usage())["pids"] >= 1
        assert [s.id for s in await grove.AsyncSandbox.list(labels={"t": "async"}, client=aclient)] == [sbx.id]
    assert not await sbx.is_running()
    with pytest.raises(grove.NotFound):
        await sbx.exec("true")
    with pytest.raises(grove.InvalidRequest) as e:
        await grove.AsyncSandbox.create(cpu=0, client=aclient)
    assert e.value.field == "cpu" and "cores" in e.value.message
