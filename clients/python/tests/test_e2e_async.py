"""The issue's end-to-end test: 32 sandboxes created concurrently with asyncio, a command in each, one
snapshotted mid-task, forked 8 ways, the branches diverge, everything deleted, zero residue."""

import asyncio
import time

import grove

N = 32
BRANCHES = 8

# A task that makes progress step by step and records it: a snapshot taken mid-way carries the progress.
TASK = "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); echo $i > /tmp/progress; sleep 0.05; done"


async def test_32_concurrent_snapshot_fork_8_diverge_zero_residue(groved, aclient):
    t0 = time.monotonic()
    sbxs = await asyncio.gather(*[
        grove.AsyncSandbox.create(memory_mb=128, cpu=0.25, timeout=600, labels={"e2e": "32"}, env={"IDX": str(i)},
                                  client=aclient)
        for i in range(N)])
    assert len({s.id for s in sbxs}) == N
    created = time.monotonic() - t0

    results = await asyncio.gather(*[s.exec("echo $IDX $(hostname) && python3 -c 'print(6*7)'") for s in sbxs])
    for i, r in enumerate(results):
        assert r.exit_code == 0, r.stderr
        idx, _host, answer = r.stdout.split()
        assert (idx, answer) == (str(i), "42")

    # One sandbox mid-task: a background job with state in memory (the shell's counter) and on disk.
    src = sbxs[5]
    await src.files.write("/root/notes.txt", "before the snapshot\n")
    await src.commands.start(TASK)
    await asyncio.sleep(1.0)
    snap = await src.snapshot(name="e2e-mid-task")
    at_snapshot = int((await src.files.read("/tmp/progress")).strip())
    assert at_snapshot > 0

    t1 = time.monotonic()
    branches = await snap.fork(BRANCHES, labels={"e2e": "branch"})
    forked = time.monotonic() - t1
    assert len(branches) == BRANCHES and len({b.id for b in branches} | {s.id for s in sbxs}) == N + BRANCHES

    async def diverge(i, b):
        # Each branch resumes the task from the snapshot point (not from zero) ...
        first = int((await b.files.read("/tmp/progress")).strip())
        assert first >= at_snapshot - 40, (first, at_snapshot)
        assert await b.files.read("/root/notes.txt") == "before the snapshot\n"
        await asyncio.sleep(0.5)
        later = int((await b.files.read("/tmp/progress")).strip())
        assert later > first, "the restored task keeps running"
        # ... and then goes its own way.
        r = await b.exec(f"echo branch-{i} >> /root/notes.txt; python3 -c 'import random; print(random.random())'")
        assert r.exit_code == 0, r.stderr
        return (await b.files.read("/root/notes.txt"), r.stdout)

    outcomes = await asyncio.gather(*[diverge(i, b) for i, b in enumerate(branches)])
    notes = [n for n, _ in outcomes]
    assert len(set(notes)) == BRANCHES, "branches must diverge"
    for i, n in enumerate(notes):
        assert n == f"before the snapshot\nbranch-{i}\n"
    assert len({r for _, r in outcomes}) == BRANCHES, "each branch has its own random state"
    # The source is untouched by its branches.
    assert await src.files.read("/root/notes.txt") == "before the snapshot\n"
    # A snapshot answered only once its images are stored says so, with the bytes it added.
    stored = await src.snapshot(durable=True)
    assert stored.durable and stored.info["size_bytes"] > 0, stored.info
    await stored.delete()

    await asyncio.gather(*[s.kill() for s in sbxs + branches])
    await snap.delete()
    left = await grove.AsyncSandbox.list(client=aclient)
    assert left == [], left
    residue = groved.residue()
    assert residue["clean"] is True, residue
    print(f"created {N} in {created:.2f}s, forked {BRANCHES} in {forked:.2f}s")
