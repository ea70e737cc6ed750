"""Client behaviour without a daemon: retries (only on connection errors, 429 and 503), error mapping, bodies."""

import httpx
import pytest

import grove
from grove._api import create_body, exec_body, network_body

FAST = grove.RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)


def client_with(handler):
    return grove.Client(base_url="http://test", retry=FAST, transport=httpx.MockTransport(handler))


def test_retries_503_and_429_then_succeeds():
    answers = [httpx.Response(503, json={"code": "unavailable", "message": "draining", "field": None}),
               httpx.Response(429, headers={"Retry-After": "0"}, json={"code": "capacity_exceeded", "message": "full", "field": None}),
               httpx.Response(200, json={"status": "ok", "draining": False})]
    calls = []

    def handler(req):
        calls.append(req)
        return answers[len(calls) - 1]

    assert client_with(handler).request("GET", "/v1/health").json()["status"] == "ok"
    assert len(calls) == 3


def test_retries_connection_errors_then_gives_up():
    calls = []

    def handler(req):
        calls.append(req)
        raise httpx.ConnectError("refused", request=req)

    with pytest.raises(grove.ConnectionFailed):
        client_with(handler).request("GET", "/v1/health")
    assert len(calls) == FAST.attempts


def test_no_retry_on_500_or_4xx():
    for status, exc in [(500, grove.ServerError), (404, grove.NotFound), (409, grove.Conflict), (422, grove.InvalidRequest)]:
        calls = []

        def handler(req):
            calls.append(req)
            return httpx.Response(status, json={"code": "x", "message": "m", "field": "limits.memory_mb"})

        with pytest.raises(exc) as e:
            client_with(handler).request("POST", "/v1/sandboxes", json={})
        assert len(calls) == 1
        assert e.value.status == status and e.value.field == "limits.memory_mb"


def test_a_failing_command_is_a_result_not_a_retry():
    calls = []

    def handler(req):
        calls.append(req)
        if req.url.path.endswith("/exec"):
            return httpx.Response(200, json={"exit_code": 1, "signal": None, "timed_out": False, "stdout": "",
                                             "stderr": "Zm9v", "encoding": "base64", "duration_ms": 3})
        return httpx.Response(201, json={"id": "sb-000000000001", "state": "running", "image": "debian12",
                                         "hostname": "h", "labels": {}})

    c = client_with(handler)
    sbx = grove.Sandbox.create(client=c)
    r = sbx.exec("false")
    assert (r.exit_code, r.stderr, r.ok) == (1, "foo", False)
    assert len(calls) == 2
    assert "Idempotency-Key" in calls[0].headers


def test_exhausted_429_raises_capacity_exceeded():
    def handler(req):
        return httpx.Response(429, headers={"Retry-After": "0"}, json={"code": "capacity_exceeded", "message": "full", "field": None})

    with pytest.raises(grove.CapacityExceeded) as e:
        client_with(handler).request("POST", "/v1/sandboxes", json={})
    assert e.value.retry_after == 0


def test_bodies():
    assert create_body(image="i", cpu=0.5, memory_mb=64, timeout=30, labels={"a": "b"}) == {
        "image": "i", "limits": {"cpu_millis": 500, "memory_mb": 64}, "ttl_secs": 30, "labels": {"a": "b"}}
    assert create_body(image="i", job="rollout-a", priority=2) == {"image": "i", "job": "rollout-a", "priority": 2}
    assert create_body(image="i", userns=True) == {"image": "i", "userns": True}
    assert create_body(image="i", userns=False) == {"image": "i"}
    with pytest.raises(grove.InvalidRequest) as e:
        create_body(image="i", userns="yes")
    assert e.value.field == "userns"
    assert network_body(["10.0.0.0/8:80,443", {"cidr": "1.1.1.1/32"}]) == {
        "mode": "egress", "allow": [{"cidr": "10.0.0.0/8", "ports": [80, 443]}, {"cidr": "1.1.1.1/32", "ports": []}]}
    assert network_body("none") == {"mode": "none"}
    assert exec_body(["ls", "-l"], timeout=1.5, stdin="x") == {"argv": ["ls", "-l"], "timeout_ms": 1500, "stdin": "eA==",
                                                               "encoding": "base64"}


def test_fleet_node_slots_and_labels():
    from grove.ray.fleet import FleetNode, _matches
    from grove.ray.node import labels, slots

    node = {"capacity": {"total": {"sandboxes": 4096, "memory_mb": 8192}}, "labels": {"pool": "rl", "bad": "a b"}}
    assert slots(node, 256) == 32  # memory runs out first
    assert slots(node, 0) == 4096
    lab = labels(node, ["debian12"], 7070, gpu=False)
    assert lab == {"grove.io/port": "7070", "grove.io/gpu": "false", "grove.io/image.debian12": "cached",
                   "grove.io/pool": "rl"}  # a value Ray cannot carry is left out
    n = FleetNode("abc", "http://x:7070", {}, 4, {"grove.io/pool": "rl"})
    assert _matches(n, {"grove.io/pool": "rl"}) and not _matches(n, {"grove.io/pool": "b"})
    assert not _matches(n, {"ray.io/node-id": "!in(abc,def)"}) and _matches(n, {"ray.io/node-id": "!in(def)"})


def test_snapshot_transfer_asks_only_for_missing_objects():
    seen = {}

    def source(req):
        if req.url.path.endswith("/objects"):
            return httpx.Response(200, json={"objects": ["a" * 64, "b" * 64]})
        seen["export"] = req.read()
        return httpx.Response(200, content=b"GRVSNAP1-delta")

    def target(req):
        if req.url.path == "/v1/snapshots/missing":
            return httpx.Response(200, json={"objects": ["b" * 64]})
        seen["import"] = req.read()
        return httpx.Response(201, json={"id": "s1", "name": "snap"})

    snap = grove.Snapshot({"id": "s1", "name": "snap"}, client_with(source))
    t = snap.transfer(client_with(target))
    assert b'"missing"' in seen["export"] and b"b" * 64 in seen["export"] and b"a" * 64 not in seen["export"]
    assert seen["import"] == b"GRVSNAP1-delta"
    assert (t.objects, t.objects_sent, t.bytes_sent, t.snapshot.name) == (2, 1, 14, "snap")


def test_snapshot_pull_asks_the_target_node():
    import json

    def target(req):
        assert req.url.path == "/v1/snapshots/pull"
        assert json.loads(req.read()) == {"source": "http://10.0.0.1:7070", "name": "snap", "source_api_key": "k"}
        return httpx.Response(201, json={"snapshot": {"id": "s1", "name": "snap"}, "objects": 10, "objects_sent": 2,
                                         "bytes_received": 1234})

    t = grove.Snapshot.pull("snap", "http://10.0.0.1:7070", client=client_with(target), source_api_key="k")
    assert (t.snapshot.name, t.objects, t.objects_sent, t.bytes_sent) == ("snap", 10, 2, 1234)
