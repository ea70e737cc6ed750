"""The E2B control plane through the unmodified `e2b` SDK (public API only), sync and async:
create/list/get/connect/kill, timeouts, pause -> resume, snapshots and fork, errors."""

from __future__ import annotations

import os
import time
import uuid

import httpx
import pytest

e2b = pytest.importorskip("e2b")
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    NotFoundException,
    SandboxException,
)


def test_create_list_get_connect_kill(e2b_env):
    tag = uuid.uuid4().hex[:8]
    sbx = Sandbox.create(template="base", metadata={"case": tag}, envs={"A": "1"}, timeout=120)
    try:
        assert sbx.sandbox_id.startswith("sb-")
        info = sbx.get_info()
        assert info.metadata == {"case": tag}
        assert info.state == SandboxState.RUNNING
        assert sbx.is_running()
        found = Sandbox.list(query=SandboxQuery(metadata={"case": tag})).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"case": "other"})).next_items() == []
        # Another client connects by id and reaches the same sandbox's files.
        sbx.files.write("/tmp/hello.txt", "from the first client")
        other = Sandbox.connect(sbx.sandbox_id)
        assert other.files.read("/tmp/hello.txt") == "from the first client"
    finally:
        assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert all(s.sandbox_id != sbx.sandbox_id for s in Sandbox.list().next_items())


def test_list_paginates(e2b_env):
    tag = uuid.uuid4().hex[:8]
    made = [Sandbox.create(metadata={"page": tag}, timeout=120) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": tag}), limit=2)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next
        rest = pager.next_items()
        assert len(rest) == 1 and not pager.has_next
        assert sorted(s.sandbox_id for s in first + rest) == sorted(s.sandbox_id for s in made)
    finally:
        for s in made:
            s.kill()


def test_wrong_api_key_and_unknown_template(e2b_env):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "0" * 40)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="wrong").next_items()
    with pytest.raises(SandboxException) as err:
        Sandbox.create(template="no-such-template")
    assert "not found" in str(err.value)


def test_bad_input_is_a_4xx_naming_the_field(e2b_env):
    headers = {"X-API-Key": e2b_env.api_key}
    url = f"http://{e2b_env.e2b}"
    bad = [
        ({"templateID": "base", "timeout": -5}, "timeout"),
        ({"templateID": "base", "metadata": {"e2b.access-token": "x"}}, "metadata"),
        ({"templateID": "base", "envVars": {"A=B": "1"}}, "envVars"),
        ({"templateID": 7}, "templateID"),
        ({}, "templateID"),
    ]
    for body, field in bad:
        r = httpx.post(f"{url}/v2/sandboxes", json=body, headers=headers)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert field in r.json()["message"], r.text
    r = httpx.post(f"{url}/v2/sandboxes", content=b"{not json", headers=headers)
    assert r.status_code == 400
    for path in ["/sandboxes/sb-000000000000", "/sandboxes/nonsense", "/sandboxes/../etc"]:
        r = httpx.get(url + path, headers=headers)
        assert r.status_code == 404, (path, r.text)
    # Sandbox traffic for a sandbox that does not exist: E2B's "not found" answer, not a 5xx of ours.
    r = httpx.get(f"{url}/files?path=/etc/hostname", headers={"E2b-Sandbox-Id": "sb-000000000000"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_sandbox_timeout_expires(e2b_env):
    sbx = Sandbox.create(timeout=1)
    deadline = time.time() + 15
    while sbx.is_running() and time.time() < deadline:
        time.sleep(0.2)
    assert not sbx.is_running()
    with pytest.raises(NotFoundException):
        sbx.get_info()


def test_set_timeout_moves_the_deadline(e2b_env):
    sbx = Sandbox.create(timeout=30)
    try:
        before = sbx.get_info().end_at
        sbx.set_timeout(600)
        after = sbx.get_info().end_at
        assert (after - before).total_seconds() > 500
    finally:
        sbx.kill()


def test_pause_then_connect_resumes(e2b_env):
    sbx = Sandbox.create(timeout=120)
    try:
        sbx.files.write("/tmp/state.txt", "kept across pause")
        assert sbx.pause() is True
        assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
        assert sbx.pause() is False  # already paused: E2B's 409
        assert any(s.sandbox_id == sbx.sandbox_id
                   for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items())
        back = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert back.get_info().state == SandboxState.RUNNING
        assert back.files.read("/tmp/state.txt") == "kept across pause"
    finally:
        sbx.kill()


def test_auto_pause_at_the_timeout_keeps_the_sandbox(e2b_env):
    sbx = Sandbox.create(timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        # As root: CRIU reads every process's rlimits, which for another uid's process takes
        # CAP_SYS_RESOURCE, and this machine's root lacks it (bounding set).
        sbx.commands.run("echo kept > /tmp/auto.txt; sleep 600 >/dev/null 2>&1 &", user="root")
        deadline = time.monotonic() + 30
        while Sandbox.get_info(sbx.sandbox_id).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "not paused at its timeout"
            time.sleep(0.2)
        back = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert back.files.read("/tmp/auto.txt") == "kept\n"
        # The process it had runs on: its memory came back with it.
        assert back.commands.run("pgrep -x sleep").exit_code == 0
    finally:
        sbx.kill()
    # Without the option the timeout kills it.
    plain = Sandbox.create(timeout=1)
    deadline = time.monotonic() + 30
    while plain.is_running():
        assert time.monotonic() < deadline, "not killed at its timeout"
        time.sleep(0.2)


def test_connect_the_moment_it_reads_paused_waits_for_the_pause(e2b_env):
    """A sandbox reads paused while its pause still parks it; a connect then must wait for the
    pause to land and resume it, not answer 409 (the auto-pause test met that window)."""
    import threading

    sbx = Sandbox.create(timeout=120)
    try:
        sbx.commands.run("echo kept > /tmp/moment.txt; sleep 600 >/dev/null 2>&1 &", user="root")
        pausing = threading.Thread(target=sbx.pause)
        pausing.start()
        deadline = time.monotonic() + 30
        while Sandbox.get_info(sbx.sandbox_id).state != SandboxState.PAUSED:
            assert time.monotonic() < deadline, "never read paused"
        back = Sandbox.connect(sbx.sandbox_id, timeout=60)
        pausing.join()
        assert back.files.read("/tmp/moment.txt") == "kept\n"
        assert back.commands.run("pgrep -x sleep").exit_code == 0
    finally:
        sbx.kill()


def test_fork_into_four_that_diverge(e2b_env):
    sbx = Sandbox.create(timeout=120)
    forks = []
    try:
        sbx.files.write("/tmp/origin.txt", "before the fork")
        forks = sbx.fork(count=4)
        errors = [f for f in forks if isinstance(f, Exception)]
        if errors and "CRIU" in str(errors[0]) or errors and "snapshot" in str(errors[0]).lower():
            pytest.skip(f"fork needs CRIU on this node: {errors[0]}")
        assert errors == []
        assert len({f.sandbox_id for f in forks} | {sbx.sandbox_id}) == 5
        for i, f in enumerate(forks):
            assert f.files.read("/tmp/origin.txt") == "before the fork"
            f.files.write("/tmp/mine.txt", f"fork {i}")
        for i, f in enumerate(forks):
            assert f.files.read("/tmp/mine.txt") == f"fork {i}"
        assert not sbx.files.exists("/tmp/mine.txt")
        # Every branch has an access token of its own (E2B's REST detail hands it out), and one
        # branch's token opens no other sandbox.
        api, key = os.environ["E2B_API_URL"], os.environ["E2B_API_KEY"]
        tokens = [httpx.get(f"{api}/sandboxes/{x.sandbox_id}", headers={"X-API-Key": key}).json()
                  ["envdAccessToken"] for x in [*forks, sbx]]
        assert all(tokens) and len(set(tokens)) == 5, tokens
        url = os.environ["E2B_SANDBOX_URL"]
        for token, other in [(tokens[0], forks[1].sandbox_id), (tokens[0], sbx.sandbox_id)]:
            r = httpx.get(f"{url}/files", params={"path": "/tmp/origin.txt", "username": "root"},
                          headers={"E2b-Sandbox-Id": other, "X-Access-Token": token})
            assert r.status_code == 401, r.text
        r = httpx.get(f"{url}/files", params={"path": "/tmp/origin.txt", "username": "root"},
                      headers={"E2b-Sandbox-Id": forks[0].sandbox_id, "X-Access-Token": tokens[0]})
        assert (r.status_code, r.text) == (200, "before the fork"), r.text
    finally:
        for f in forks:
            if not isinstance(f, Exception):
                f.kill()
        sbx.kill()


def test_snapshot_then_create_from_it(e2b_env):
    sbx = Sandbox.create(timeout=120)
    made = None
    try:
        sbx.files.write("/tmp/snap.txt", "in the snapshot")
        snap = sbx.create_snapshot()
        made = Sandbox.create(template=snap.snapshot_id, timeout=120)
        assert made.files.read("/tmp/snap.txt") == "in the snapshot"
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        if made is not None:
            made.kill()
        sbx.kill()


def test_metrics(e2b_env):
    sbx = Sandbox.create(timeout=60)
    try:
        m = sbx.get_metrics()
        assert len(m) == 1 and m[0].mem_total > 0
    finally:
        sbx.kill()


async def test_async_sandbox_lifecycle(e2b_env):
    sbx = await AsyncSandbox.create(metadata={"async": "1"}, timeout=120)
    try:
        info = await sbx.get_info()
        assert info.metadata == {"async": "1"}
        await sbx.files.write("/tmp/a.txt", b"\x00\x01async")
        assert await sbx.pause() is True
        back = await AsyncSandbox.connect(sbx.sandbox_id)
        assert await back.files.read("/tmp/a.txt", format="bytes") == b"\x00\x01async"
        await sbx.set_timeout(300)
    finally:
        assert await sbx.kill() is True
    with pytest.raises(AuthenticationException):
        await AsyncSandbox.create(api_key="wrong")
