"""SWE-ReX through its own, unmodified client (`swerex.runtime.remote.RemoteRuntime`, from PyPI) against the
protocol groved serves per sandbox: sessions (heredoc edits, `check`, timeouts, interactive programs),
execute, files, uploads (a zipped directory, and a hostile zip), X-Request-ID retries, forking mid-session."""

from __future__ import annotations

import io
import uuid
import zipfile

import aiohttp
import pytest
from swerex.exceptions import (BashIncorrectSyntaxError, CommandTimeoutError, NonZeroExitCodeError,
                               SessionDoesNotExistError, SessionExistsError, SessionNotInitializedError)
from swerex.runtime.abstract import (BashAction, BashInterruptAction, CloseBashSessionRequest, Command,
                                     CreateBashSessionRequest, ReadFileRequest, UploadRequest, WriteFileRequest)
from swerex.runtime.remote import RemoteRuntime

from grove.swerex import GroveDeployment


@pytest.fixture
async def deployment(groved):
    d = GroveDeployment(url=f"http://{groved.tcp}", api_key=groved.api_key,
                        sandbox={"memory_mb": 256, "timeout": 600, "labels": {"test": "swerex"}})
    await d.start()
    yield d
    await d.stop()


def run(cmd: str, **kw) -> BashAction:
    return BashAction(command=cmd, timeout=kw.pop("timeout", 30), **kw)


async def test_session_heredoc_edit_check_and_state(deployment):
    rt = deployment.runtime
    assert (await deployment.is_alive()).is_alive
    await rt.create_session(CreateBashSessionRequest(session="main"))
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest(session="main"))

    await rt.run_in_session(run("mkdir -p /src && cd /src && export GREETING=hello", session="main"))
    # The agent writes a file with a heredoc, as SWE-agent's edit tools do.
    edit = "cat > /src/calc.py <<'EOF'\ndef add(a, b):\n    return a - b\nEOF"
    await rt.run_in_session(run(edit, session="main"))
    test = "python3 -B -c 'import calc; assert calc.add(2, 3) == 5, calc.add(2, 3)'"
    with pytest.raises(NonZeroExitCodeError) as e:
        await rt.run_in_session(run(test, session="main", error_msg="tests fail"))
    assert "tests fail" in str(e.value) and "exit code 1" in str(e.value)
    silent = await rt.run_in_session(run(test, session="main", check="silent"))
    assert silent.exit_code == 1 and "AssertionError: -1" in silent.output
    ignored = await rt.run_in_session(run("false", session="main", check="ignore"))
    assert ignored.exit_code is None

    await rt.run_in_session(run("sed -i 's/a - b/a + b/' calc.py", session="main"))
    ok = await rt.run_in_session(run(f"{test} && echo PASSED", session="main"))
    assert ok.exit_code == 0 and ok.output.strip() == "PASSED"
    # cwd and exported variables carried from the first action.
    where = await rt.run_in_session(run("pwd; echo $GREETING", session="main"))
    assert where.output.split() == ["/src", "hello"]

    assert "a + b" in (await rt.read_file(ReadFileRequest(path="/src/calc.py"))).content
    await rt.write_file(WriteFileRequest(path="/src/deep/new/notes.txt", content="hé\n"))
    assert (await rt.read_file(ReadFileRequest(path="/src/deep/new/notes.txt"))).content == "hé\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/src/missing.txt"))

    with pytest.raises(BashIncorrectSyntaxError):
        await rt.run_in_session(run('echo "unterminated', session="main"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(run("true", session="nope"))

    # A command that never ends: the timeout interrupts it, not the session.
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(run("sleep 600", session="main", timeout=1))
    after = await rt.run_in_session(run("echo alive; pwd", session="main"))
    assert after.output.split() == ["alive", "/src"]

    r = await rt.execute(Command(command="echo out; echo err >&2; exit 3", shell=True))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    with pytest.raises(NonZeroExitCodeError):
        await rt.execute(Command(command=["false"], check=True))
    r = await rt.execute(Command(command=["pwd"], cwd="/src"))
    assert r.stdout == "/src\n"

    await rt.close_session(CloseBashSessionRequest(session="main"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(run("true", session="main"))

    # A session whose shell dies is reported dead, on that run and every later one; others are unaffected.
    await rt.create_session(CreateBashSessionRequest(session="doomed"))
    await rt.create_session(CreateBashSessionRequest(session="other"))
    with pytest.raises(SessionNotInitializedError):
        await rt.run_in_session(run("kill -9 $$", session="doomed"))
    with pytest.raises(SessionNotInitializedError):
        await rt.run_in_session(run("echo still there?", session="doomed"))
    assert (await rt.run_in_session(run("echo fine", session="other"))).output.strip() == "fine"
    await rt.close_session(CloseBashSessionRequest(session="doomed"))


async def test_interactive_program_and_interrupt(deployment):
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest())
    started = await rt.run_in_session(BashAction(command="python3 -i -q -u", is_interactive_command=True,
                                                 expect=[">>> "], timeout=20))
    assert started.expect_string == ">>> "
    r = await rt.run_in_session(BashAction(command="print(6 * 7)", is_interactive_command=True,
                                           expect=[">>> "], timeout=20))
    assert r.output.strip() == "42", r.output
    await rt.run_in_session(BashAction(command="exit()", is_interactive_quit=True, timeout=20))
    # Back in bash; an interrupt of an idle session is harmless.
    await rt.run_in_session(BashInterruptAction())
    assert (await rt.run_in_session(run("echo back"))).output.strip() == "back"


async def test_upload_directory_and_file(deployment, tmp_path):
    rt = deployment.runtime
    src = tmp_path / "repo"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("")
    (src / "pkg" / "sub" / "data.txt").write_text("payload\n")
    (src / "README").write_text("read me\n")
    (src / "empty").mkdir()
    await rt.upload(UploadRequest(source_path=str(src), target_path="/work/repo"))
    listing = await rt.execute(Command(command="cd /work/repo && find . | sort", shell=True))
    assert listing.stdout.split() == [".", "./README", "./empty", "./pkg", "./pkg/__init__.py", "./pkg/sub",
                                      "./pkg/sub/data.txt"]
    assert (await rt.read_file(ReadFileRequest(path="/work/repo/pkg/sub/data.txt"))).content == "payload\n"
    one = tmp_path / "one.txt"
    one.write_bytes(b"\x00\x01binary")
    await rt.upload(UploadRequest(source_path=str(one), target_path="/work/files/one.bin"))
    r = await rt.execute(Command(command=["od", "-An", "-c", "/work/files/one.bin"]))
    assert "b   i   n" in r.stdout


async def _post(groved, sid: str, route: str, **kw) -> aiohttp.ClientResponse:
    headers = {"X-API-Key": groved.api_key, **kw.pop("headers", {})}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://{groved.tcp}/v1/sandboxes/{sid}/swerex/{route}", headers=headers, **kw) as r:
            await r.read()
            return r


async def test_hostile_zip_and_auth_are_refused(groved, deployment):
    sid = deployment.sandbox_id
    # Zip-slip: members that climb out of the target (and out of the sandbox root) are refused whole.
    for name in ["../../../../../../tmp/grove-rex-escape", "/etc/grove-rex-abs", "a/../../grove-rex-up"]:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("fine.txt", "ok")
            z.writestr(name, "pwned")
        form = aiohttp.FormData()
        form.add_field("file", buf.getvalue(), filename="x.zip", content_type="application/zip")
        form.add_field("target_path", "/work/zip")
        form.add_field("unzip", "true")
        r = await _post(groved, sid, "upload", data=form)
        assert r.status == 422, (name, r.status)
    r = await deployment.runtime.execute(Command(command="ls /tmp /etc /work 2>&1 | grep -c grove-rex", shell=True))
    assert r.stdout.strip() == "0"
    import os
    assert not os.path.exists("/tmp/grove-rex-escape") and not os.path.exists("/etc/grove-rex-abs")
    # A damaged member (flipped byte in stored data) is refused and leaves no half file.
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("victim.txt", "x" * 1000)
    data = bytearray(buf.getvalue())
    data[data.index(b"xxxx") + 10] ^= 0xFF
    form = aiohttp.FormData()
    form.add_field("file", bytes(data), filename="x.zip")
    form.add_field("target_path", "/work/damaged")
    form.add_field("unzip", "true")
    assert (await _post(groved, sid, "upload", data=form)).status == 422
    r = await deployment.runtime.execute(Command(command="test -e /work/damaged/victim.txt", shell=True))
    assert r.exit_code == 1

    # The node's key, nothing else; X-API-Key is accepted on these routes only.
    bad = RemoteRuntime(host=f"http://{groved.tcp}/v1/sandboxes/{sid}/swerex", port=None, auth_token="wrong")
    assert not (await bad.is_alive(timeout=5)).is_alive
    with pytest.raises(aiohttp.ClientResponseError) as e:
        await bad.execute(Command(command=["true"]))
    assert e.value.status == 401
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://{groved.tcp}/v1/sandboxes", headers={"X-API-Key": groved.api_key}) as r:
            assert r.status == 401


async def test_request_id_retries_run_once(groved, deployment):
    sid = deployment.sandbox_id
    await deployment.runtime.create_session(CreateBashSessionRequest())
    action = run("echo tick >> /tmp/ticks; wc -l < /tmp/ticks").model_dump()
    rid = str(uuid.uuid4())
    first = await _post(groved, sid, "run_in_session", json=action, headers={"X-Request-ID": rid})
    again = await _post(groved, sid, "run_in_session", json=action, headers={"X-Request-ID": rid})
    assert first.status == again.status == 200 and again.headers.get("idempotent-replayed") == "true"
    assert (await deployment.runtime.read_file(ReadFileRequest(path="/tmp/ticks"))).content == "tick\n"
    other = dict(action, command="true")
    assert (await _post(groved, sid, "run_in_session", json=other, headers={"X-Request-ID": rid})).status == 422
    fresh = await _post(groved, sid, "run_in_session", json=action, headers={"X-Request-ID": str(uuid.uuid4())})
    assert fresh.status == 200
    assert (await deployment.runtime.read_file(ReadFileRequest(path="/tmp/ticks"))).content == "tick\ntick\n"


async def test_fork_mid_session_branches_diverge(deployment):
    rt = deployment.runtime
    await rt.create_session(CreateBashSessionRequest(session="agent"))
    await rt.run_in_session(run("mkdir -p /proj && cd /proj && export STAGE=before-fork && echo v0 > state",
                                session="agent"))
    await rt.run_in_session(run("(while true; do echo t >> /proj/ticks; sleep 0.1; done) &", session="agent"))
    branches = await deployment.fork(2)
    try:
        for i, b in enumerate(branches):
            assert (await b.is_alive()).is_alive
            r = await b.runtime.run_in_session(run("echo $PWD $STAGE $(cat state); jobs -r | grep -c 'while true'", session="agent"))
            assert r.output.split() == ["/proj", "before-fork", "v0", "1"], r.output
            await b.runtime.run_in_session(run(f"export STAGE=branch-{i} && echo v{i + 1} > state", session="agent"))
        seen = [(await b.runtime.run_in_session(run("echo $STAGE $(cat state)", session="agent"))).output.split()
                for b in branches]
        assert seen == [["branch-0", "v1"], ["branch-1", "v2"]]
        # The branches' background jobs keep running, each in its own sandbox.
        for b in branches:
            n1 = int((await b.runtime.execute(Command(command="wc -l < /proj/ticks", shell=True))).stdout)
            await b.runtime.run_in_session(run("sleep 0.5", session="agent"))
            n2 = int((await b.runtime.execute(Command(command="wc -l < /proj/ticks", shell=True))).stdout)
            assert n2 > n1
        src = await rt.run_in_session(run("echo $STAGE $(cat state)", session="agent"))
        assert src.output.split() == ["before-fork", "v0"]
    finally:
        for b in branches:
            await b.stop()
