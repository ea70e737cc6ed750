"""What placing through Ray costs, on the three-node test fleet (not part of CI; run as root):

    GROVED_BIN=target/debug/groved PYTHONPATH=clients/python \\
        /var/lib/grove/venv/bin/python clients/python/tests/fleet_bench.py [rounds]

Prints, from one run: Ray placement alone (one-slot placement groups placed and removed per second);
`Fleet.create` of a batch against the same batch created directly on one node's groved (the ratio is the
placement overhead); one-at-a-time creates with a placement group per sandbox against blocks of 8; and the load
average at start."""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from fleet_cluster import Cluster  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    load = open("/proc/loadavg").read().split()[:3]
    c = Cluster([{"sandboxes": 64, "labels": {"pool": "a"}}, {"sandboxes": 64}, {"sandboxes": 64}])
    try:
        c.start()
        c.enter()
        import grove
        import ray
        from grove.ray import SLOT, Fleet
        from ray.util.placement_group import placement_group, remove_placement_group

        fleet = Fleet(address=f"{c.subnet}.1:6379", api_key=c.api_key)
        try:
            n = 300
            t = time.perf_counter()
            pgs = [placement_group([{SLOT: 1}], strategy="SPREAD") for _ in range(n)]
            # 192 slots in all: the first 192 place, the rest wait; remove as we go to keep the pipe full.
            placed = 0
            for pg in pgs[:150]:
                placed += pg.wait(30)
            for pg in pgs[:150]:
                remove_placement_group(pg)
            for pg in pgs[150:]:
                placed += pg.wait(30)
            for pg in pgs[150:]:
                remove_placement_group(pg)
            pg_rate = placed / (time.perf_counter() - t)

            direct, placed_t = [], []
            one = grove.Client(base_url=c.nodes[1].url, api_key=c.api_key)
            for _ in range(rounds):
                t = time.perf_counter()
                sbxs = grove.Sandbox.create_many(12, client=one)
                direct.append(time.perf_counter() - t)
                for s in sbxs:
                    s.kill()
                t = time.perf_counter()
                sbxs = fleet.create(count=12)
                placed_t.append(time.perf_counter() - t)
                for s in sbxs:
                    s.kill()
            one.close()

            def singles(f: Fleet, n: int = 24) -> float:
                """Seconds per sandbox for n one-at-a-time creates (then all killed)."""
                t = time.perf_counter()
                made = [f.create(count=1)[0] for _ in range(n)]
                per = (time.perf_counter() - t) / n
                for s in made:
                    s.kill()
                return per

            blocky = Fleet(address=f"{c.subnet}.1:6379", api_key=c.api_key, block=8)
            try:
                one_by_one = [(singles(fleet), singles(blocky)) for _ in range(rounds)]
                groups = blocky._slots.groups_created
            finally:
                blocky.close()
            s1 = statistics.median(a for a, _ in one_by_one)
            s8 = statistics.median(b for _, b in one_by_one)
            d, p = statistics.median(direct), statistics.median(placed_t)
            print(f"load at start {' '.join(load)}; Ray {ray.__version__}")
            print(f"ray placement: {placed} one-slot placement groups placed+removed at {pg_rate:.0f}/s")
            print(f"create 12, median of {rounds}: direct on one node {d * 1000:.0f} ms; Fleet.create over 3 nodes "
                  f"{p * 1000:.0f} ms ({p / d:.2f}x)")
            print(f"24 creates of 1, median of {rounds}: {s1 * 1000:.1f} ms each with a placement group per sandbox; "
                  f"{s8 * 1000:.1f} ms each with blocks of 8 ({s8 / s1:.2f}x; {groups} groups for "
                  f"{24 * rounds} sandboxes)")
        finally:
            fleet.close()
    finally:
        c.leave()
        left = c.teardown()
        if left:
            print("residue:\n" + "\n".join(left))
            sys.exit(1)


if __name__ == "__main__":
    main()
