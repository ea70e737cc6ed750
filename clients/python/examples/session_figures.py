"""Issue 23's session figures: `run` in a session vs a plain exec (p50), and a fork of a sandbox with a live
session into 8 branches, every branch's session answering.

    GROVE_SOCKET=/run/grove/groved.sock python3 clients/python/examples/session_figures.py [runs]

(clients/python/tests/test_sessions.py runs it once against its test daemon, with fewer runs.)
"""

from __future__ import annotations

import concurrent.futures
import statistics
import sys
import time
from typing import Optional

import grove


def p50_ms(f, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def figures(runs: int = 50, branches: int = 8, client: Optional[grove.Client] = None) -> dict:
    sbx = grove.Sandbox.create(memory_mb=128, timeout=600, client=client)
    try:
        s = sbx.sessions.create("main")
        s.run("cd /tmp && export MARK=live; sleep 600 &")
        exec_p50 = p50_ms(lambda: sbx.exec("true"), runs)
        run_p50 = p50_ms(lambda: s.run("true"), runs)
        snap = sbx.snapshot()
        t = time.perf_counter()
        forked = snap.fork(branches)
        fork_s = time.perf_counter() - t

        def answer(b: grove.Sandbox) -> str:
            return b.sessions.get("main").run("echo $MARK $(pwd) $(jobs | wc -l)").output

        with concurrent.futures.ThreadPoolExecutor(branches) as pool:
            outs = list(pool.map(answer, forked))
        all_s = time.perf_counter() - t
        answering = sum(o == "live /tmp 1\n" for o in outs)
        for b in forked:
            b.kill()
        snap.delete()
        return {"exec_p50_ms": round(exec_p50, 2), "session_run_p50_ms": round(run_p50, 2),
                "fork_branches": branches, "fork_s": round(fork_s, 3),
                "fork_and_all_sessions_answer_s": round(all_s, 3), "sessions_answering": answering}
    finally:
        sbx.kill()


if __name__ == "__main__":
    print(figures(int(sys.argv[1]) if len(sys.argv) > 1 else 50))
