"""Driver of grove-bench's `e2b` scenario: the same daemon through E2B's SDK and through Grove's own Python
client. Prints one JSON object of latencies in ms (lists), or {"error": ...}.

usage: driver.py E2B_ADDR GROVED_SOCKET IMAGE N_RUN N_CREATE FORK_N

create → first command is measured twice: cold (the node builds the sandbox for the create), then with a
warm pool of the template configured on the node (PUT /v1/pools: the create is a hand-over), each sample
taken once the pool holds a ready sandbox again."""

import json
import os
import sys
import time
import traceback


# E2B's SDK runs every commands.run(cmd) as `/bin/bash -l -c cmd` (e2b/sandbox_sync/commands).
SDK_ARGV = ["/bin/bash", "-l", "-c", "true"]


def ms(t0):
    return (time.perf_counter() - t0) * 1000.0


def ready(node, image, timeout=30.0):
    """Waits until the node's pool of `image` holds an idle sandbox."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p["image"] == image and p["idle"] >= 1 for p in node.get("/v1/pools").json()["pools"]):
            return
        time.sleep(0.005)
    raise TimeoutError(f"the pool of {image} did not refill in {timeout} s")


def main():
    addr, sock, image, n_run, n_create, fork_n = sys.argv[1:7]
    n_run, n_create, fork_n = int(n_run), int(n_create), int(fork_n)
    os.environ.update(E2B_API_URL=f"http://{addr}", E2B_SANDBOX_URL=f"http://{addr}", E2B_API_KEY="e2b_bench")
    import grove
    import httpx
    from e2b import Sandbox

    out = {"sdk_run": [], "grove_run": [], "create_first": [], "create_first_pooled": [], "fork": None}
    client = grove.Client(socket=sock)
    sdk = Sandbox.create(template=image, timeout=600)
    native = grove.Sandbox.connect(sdk.sandbox_id, client=client)
    try:
        for i in range(n_run + 2):  # two warm-up rounds, interleaved one for one
            t = time.perf_counter()
            sdk.commands.run("true")
            a = ms(t)
            t = time.perf_counter()
            # What the SDK runs for commands.run("true"), as the SDK's default user: the same
            # command, so that the difference is the path alone.
            r = native.exec(SDK_ARGV, user="user")
            b = ms(t)
            assert r.exit_code == 0
            if i >= 2:
                out["sdk_run"].append(a)
                out["grove_run"].append(b)
        for _ in range(n_create):
            t = time.perf_counter()
            s = Sandbox.create(template=image, timeout=60)
            s.commands.run("true")
            out["create_first"].append(ms(t))
            s.kill()
        node = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://groved", timeout=60)
        try:
            put = node.put("/v1/pools", json={"pools": [{"image": image, "mode": "fixed", "max": 1}]})
            assert put.status_code == 200, put.text
            for _ in range(n_create):
                ready(node, image)
                t = time.perf_counter()
                s = Sandbox.create(template=image, timeout=60)
                s.commands.run("true")
                out["create_first_pooled"].append(ms(t))
                s.kill()
            hits = sum(p["hits"] for p in node.get("/v1/pools").json()["pools"] if p["image"] == image)
            assert hits >= n_create, f"only {hits} of {n_create} creates came from the pool"
        finally:
            node.put("/v1/pools", json={"pools": []})
            node.close()
        if fork_n and hasattr(sdk, "fork"):
            try:
                t = time.perf_counter()
                kids = sdk.fork(fork_n)
                out["fork"] = [ms(t)]
                for k in kids:
                    k.kill()
            except Exception as e:  # the control plane may not fork yet
                out["fork_error"] = f"{type(e).__name__}: {e}"
    finally:
        sdk.kill()
        client.close()
    print(json.dumps(out))


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}))
        sys.exit(1)
