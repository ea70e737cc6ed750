"""The client's promises without a daemon, sync and async alike: no raw httpx exception escapes, a call that
could run twice is never retried, bad arguments are refused before anything is sent, bodies stream."""

import asyncio
import json

import httpx
import pytest

import grove

FAST = grove.RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)
SBX = {"id": "sb-000000000001", "state": "running", "image": "debian12", "hostname": "h", "labels": {},
       "ports": [{"host_port": 18080, "sandbox_port": 8080}]}
EXEC_OK = {"exit_code": 0, "signal": None, "timed_out": False, "stdout": "", "stderr": "", "encoding": "base64",
           "duration_ms": 1}


class Mode:
    """Runs the same scenario through the sync or the asyncio client."""

    def __init__(self, asynchronous):
        self.asynchronous = asynchronous

    def client(self, handler, **kw):
        kw.setdefault("retry", FAST)
        if self.asynchronous:
            async def ah(req):
                await req.aread()
                return handler(req)
            return grove.AsyncClient(base_url="http://test", transport=httpx.MockTransport(ah), **kw)
        return grove.Client(base_url="http://test", transport=httpx.MockTransport(handler), **kw)

    @property
    def Sandbox(self):
        return grove.AsyncSandbox if self.asynchronous else grove.Sandbox

    def run(self, value):
        return asyncio.run(_await(value)) if self.asynchronous else value


async def _await(v):
    return await v


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def mode(request):
    return Mode(request.param)


def sandbox(mode, handler):
    c = mode.client(handler)

    def h(req):
        if req.method == "POST" and req.url.path == "/v1/sandboxes":
            return httpx.Response(201, json=SBX)
        return handler(req)
    c2 = mode.client(h)
    if mode.asynchronous:
        async def make():
            return await grove.AsyncSandbox.create(client=c2)
        return mode, make
    return mode, lambda: grove.Sandbox.create(client=c2)


def test_an_exec_whose_connection_breaks_is_retried_under_its_key_a_stream_is_not(mode):
    calls = []

    def handler(req):
        calls.append((req.url.path, req.headers.get("idempotency-key")))
        if req.url.path.endswith("/exec") and len([c for c in calls if c[0] == req.url.path]) == 1:
            raise httpx.ReadError("connection reset", request=req)
        if req.url.path.endswith("/exec"):
            return httpx.Response(200, json=EXEC_OK)
        if req.url.path.endswith("/exec/stream"):
            raise httpx.ReadError("connection reset", request=req)
        return httpx.Response(201, json=SBX)

    c = mode.client(handler)
    sbx = mode.run(mode.Sandbox.create(client=c))
    assert mode.run(sbx.exec("echo side effect >> /tmp/f")).exit_code == 0
    keys = [k for p, k in calls if p.endswith("/exec")]
    assert len(keys) == 2 and keys[0] and keys[0] == keys[1]  # the same key: groved answers the first run
    with pytest.raises(grove.ConnectionLost) as e:
        mode.run(sbx.exec("echo side effect >> /tmp/f", on_stdout=print))
    assert [p for p, _ in calls].count("/v1/sandboxes/sb-000000000001/exec/stream") == 1
    assert "not sent again" in str(e.value) and "http://test" in str(e.value)


def test_a_keyed_call_and_a_get_are_retried_a_plain_post_is_not(mode):
    calls = []

    def handler(req):
        calls.append((req.method, req.url.path, req.headers.get("idempotency-key")))
        if len([c for c in calls if c[:2] == (req.method, req.url.path)]) == 1:
            raise httpx.RemoteProtocolError("peer closed", request=req)
        if req.url.path.endswith("/snapshot"):
            return httpx.Response(201, json={"id": "s", "name": "s"})
        if req.url.path.endswith("/pause"):
            return httpx.Response(200, json=SBX)
        return httpx.Response(200 if req.method == "GET" else 201, json=SBX)

    c = mode.client(handler)
    S = mode.Sandbox
    sbx = mode.run(S.create(client=c))  # retried: it carries an Idempotency-Key
    creates = [k for m, p, k in calls if p == "/v1/sandboxes"]
    assert len(creates) == 2 and creates[0] == creates[1] and creates[0]
    mode.run(S.connect(sbx.id, client=c))  # a GET: retried
    assert len([1 for m, p, _ in calls if m == "GET"]) == 2
    mode.run(sbx.snapshot())  # keyed
    snaps = [k for m, p, k in calls if p.endswith("/snapshot")]
    assert len(snaps) == 2 and snaps[0] == snaps[1]
    with pytest.raises(grove.ConnectionLost):
        mode.run(sbx.pause())  # a plain POST
    assert len([1 for m, p, _ in calls if p.endswith("/pause")]) == 1


def test_no_raw_httpx_exception_escapes(mode):
    for exc, expect in [(httpx.ReadTimeout("slow"), grove.RequestTimeout),
                        (httpx.ConnectError("refused"), grove.ConnectionFailed),
                        (httpx.WriteError("pipe"), grove.ConnectionLost),
                        (httpx.DecodingError("bad gzip"), grove.GroveError),
                        (httpx.UnsupportedProtocol("gopher"), grove.GroveError)]:
        def handler(req, exc=exc):
            exc.request = req
            raise exc

        with pytest.raises(expect) as e:
            mode.run(mode.Sandbox.create(client=mode.client(handler)))
        assert isinstance(e.value, grove.GroveError) and "http://test" in str(e.value), (exc, e.value)


def test_connection_failed_names_the_socket(tmp_path, mode):
    sock = str(tmp_path / "no-groved.sock")
    C = grove.AsyncClient if mode.asynchronous else grove.Client
    c = C(socket=sock, retry=FAST)
    with pytest.raises(grove.ConnectionFailed) as e:
        mode.run(mode.Sandbox.list(client=c))
    assert sock in str(e.value)


def test_invalid_values_are_refused_before_sending(mode):
    calls = []

    def handler(req):
        calls.append(req)
        if req.url.path.endswith("/exec"):
            return httpx.Response(200, json=EXEC_OK)
        return httpx.Response(201, json=SBX)

    c = mode.client(handler)
    S = mode.Sandbox
    for kw, field in [({"timeout": -5}, "timeout"), ({"timeout": float("nan")}, "timeout"),
                      ({"idle_timeout": 0}, "idle_timeout"), ({"cpu": -1}, "cpu"), ({"cpu": 0}, "cpu"),
                      ({"memory_mb": 0}, "memory_mb"), ({"pids": True}, "pids"), ({"ports": [70000]}, "ports[0]"),
                      ({"queue_timeout": -1}, "queue_timeout"), ({"queue_timeout": 7200}, "queue_timeout")]:
        with pytest.raises(grove.InvalidRequest) as e:
            mode.run(S.create(client=c, **kw))
        assert e.value.field == field, (kw, e.value)
    assert calls == []
    sbx = mode.run(S.create(client=c))
    for t in (-1, float("inf"), "10"):
        with pytest.raises(grove.InvalidRequest) as e:
            mode.run(sbx.exec("true", timeout=t))
        assert e.value.field == "timeout"
    with pytest.raises(grove.InvalidRequest):
        mode.run(sbx.set_timeout(-1))
    assert len(calls) == 1
    # 0 means no limit for a lifetime too: no expiry, not even the node's default TTL.
    mode.run(S.create(client=c, timeout=0))
    assert json.loads(calls[-1].content)["ttl_secs"] == 0
    # 0 means no limit for a command (as in E2B): no timeout_ms, and no deadline on the answer.
    mode.run(sbx.exec("true", timeout=0))
    assert "timeout_ms" not in json.loads(calls[-1].content)
    assert calls[-1].extensions["timeout"]["read"] is None
    mode.run(sbx.exec("true", timeout=0.0001))
    assert json.loads(calls[-1].content)["timeout_ms"] == 1  # rounded up, never to zero


def test_exec_without_timeout_has_no_read_deadline_but_lookups_do(mode):
    seen = {}

    def handler(req):
        seen[req.url.path] = req.extensions["timeout"]
        if req.url.path.endswith("/exec"):
            return httpx.Response(200, json=EXEC_OK)
        return httpx.Response(200 if req.method == "GET" else 201, json=SBX)

    c = mode.client(handler, timeout=7)
    sbx = mode.run(mode.Sandbox.create(client=c))
    mode.run(sbx.exec("sleep 1000"))
    mode.run(sbx.refresh())
    assert seen["/v1/sandboxes/sb-000000000001/exec"]["read"] is None
    assert seen["/v1/sandboxes"]["read"] is None  # a create may queue for room
    assert seen["/v1/sandboxes/sb-000000000001"]["read"] == 7
    mode.run(sbx.exec("sleep 1000", timeout=5))
    assert seen["/v1/sandboxes/sb-000000000001/exec"]["read"] == 35


def test_queue_timeout_bounds_the_wait_on_a_full_node(mode):
    calls = []

    def handler(req):
        calls.append(req)
        return httpx.Response(429, headers={"Retry-After": "0.05"},
                              json={"code": "capacity_exceeded", "message": "full", "field": None})

    slow = grove.RetryPolicy(attempts=50, base_delay=0.05, max_delay=0.05)
    c = mode.client(handler, retry=slow)
    import time
    t = time.monotonic()
    with pytest.raises(grove.CapacityExceeded):
        mode.run(mode.Sandbox.create(client=c, queue_timeout=0.2))
    assert time.monotonic() - t < 1.0 and 1 <= len(calls) <= 6
    assert json.loads(calls[0].content)["queue_timeout_ms"] == 200  # groved waits no longer either
    calls.clear()
    with pytest.raises(grove.CapacityExceeded):
        mode.run(mode.Sandbox.create(client=c, queue_timeout=0))
    assert len(calls) == 1 and json.loads(calls[0].content)["queue_timeout_ms"] == 0


def test_uploads_stream_in_chunks_with_progress(mode, tmp_path):
    got = {}

    def handler(req):
        if req.url.path.endswith("/files") and req.method == "PUT":
            got["body"] = req.content
            got["length"] = req.headers.get("content-length")
            return httpx.Response(204)
        if req.url.path.endswith("/files"):
            return httpx.Response(200, content=b"y" * (3 << 20))
        return httpx.Response(201, json=SBX)

    sbx = mode.run(mode.Sandbox.create(client=mode.client(handler)))
    src = tmp_path / "big"
    src.write_bytes(b"x" * (5 << 20) + b"tail")
    progress = []
    mode.run(sbx.files.upload(str(src), "/tmp/big", on_progress=lambda d, t: progress.append((d, t))))
    assert got["body"] == src.read_bytes() and got["length"] == str(len(got["body"]))
    assert len(progress) == 6 and progress[-1] == (len(src.read_bytes()), len(src.read_bytes()))
    down = []
    mode.run(sbx.files.download("/tmp/big", str(tmp_path / "back"), on_progress=lambda d, t: down.append(d)))
    assert (tmp_path / "back").read_bytes() == b"y" * (3 << 20) and down[-1] == 3 << 20
    assert not (tmp_path / "back.grove-part").exists()


def test_ports_and_get_host(mode):
    sbx = mode.run(mode.Sandbox.create(client=mode.client(lambda r: httpx.Response(201, json=SBX)), ports=[8080]))
    assert sbx.get_host(8080) == "test:18080"
    with pytest.raises(grove.InvalidRequest):
        sbx.get_host(9090)


def test_create_from_a_snapshot_sends_no_image(mode):
    bodies = []

    def handler(req):
        bodies.append(json.loads(req.content))
        return httpx.Response(201, json=SBX)

    c = mode.client(handler)
    mode.run(mode.Sandbox.create(snapshot="snap-1", labels={"a": "b"}, timeout=30, client=c))
    assert bodies[-1] == {"snapshot": "snap-1", "labels": {"a": "b"}, "ttl_secs": 30}
    with pytest.raises(grove.InvalidRequest) as e:
        mode.run(mode.Sandbox.create(snapshot="snap-1", memory_mb=64, client=c))
    assert e.value.field == "memory_mb"


def test_a_download_broken_midway_is_not_retried_into_the_same_buffer(mode):
    calls = []

    class Broken(httpx.SyncByteStream, httpx.AsyncByteStream):
        def __init__(self, req):
            self.req = req

        def __iter__(self):
            yield b"first-half "
            raise httpx.ReadError("reset", request=self.req)

        async def __aiter__(self):
            yield b"first-half "
            raise httpx.ReadError("reset", request=self.req)

    def handler(req):
        calls.append(req.url.path)
        if req.url.path.endswith("/files"):
            return httpx.Response(200, stream=Broken(req))
        return httpx.Response(201, json=SBX)

    sbx = mode.run(mode.Sandbox.create(client=mode.client(handler)))
    with pytest.raises(grove.ConnectionLost):
        mode.run(sbx.files.read("/x"))
    assert calls.count("/v1/sandboxes/sb-000000000001/files") == 1


def test_an_exec_given_up_on_is_ended_in_the_sandbox(mode):
    bodies = []

    def handler(req):
        if req.url.path.endswith("/exec"):
            bodies.append(json.loads(req.content))
            if len(bodies) == 1:
                raise httpx.ReadTimeout("deadline", request=req)
            return httpx.Response(200, json=EXEC_OK)
        return httpx.Response(201, json=SBX)

    async def go_async(c):
        sbx = await grove.AsyncSandbox.create(client=c)
        try:
            await sbx.exec("sleep 1000")
        finally:
            await asyncio.sleep(0.05)  # the kill is sent without holding the caller up

    c = mode.client(handler)
    with pytest.raises(grove.RequestTimeout):
        asyncio.run(go_async(c)) if mode.asynchronous else grove.Sandbox.create(client=c).exec("sleep 1000")
    assert len(bodies) == 2
    mark = bodies[0]["env"]["GROVE_EXEC_ID"]
    assert bodies[1]["argv"][-1] == mark and "kill -9" in bodies[1]["argv"][2]


def test_snapshot_transfer_moves_only_missing_objects(mode):
    seen = {}

    def source(req):
        if req.url.path.endswith("/objects"):
            return httpx.Response(200, json={"objects": ["a" * 64, "b" * 64]})
        seen["export"] = json.loads(req.content)
        return httpx.Response(200, content=b"GRVSNAP1-delta")

    def target(req):
        if req.url.path == "/v1/snapshots/missing":
            return httpx.Response(200, json={"objects": ["b" * 64]})
        seen["import"] = req.content
        return httpx.Response(201, json={"id": "s1", "name": "snap"})

    S = grove.AsyncSnapshot if mode.asynchronous else grove.Snapshot

    async def go_async():
        return await S({"id": "s1", "name": "snap"}, mode.client(source)).transfer(mode.client(target))

    t = asyncio.run(go_async()) if mode.asynchronous else \
        S({"id": "s1", "name": "snap"}, mode.client(source)).transfer(mode.client(target))
    assert seen["export"] == {"missing": ["b" * 64]} and seen["import"] == b"GRVSNAP1-delta"
    assert (t.objects, t.objects_sent, t.bytes_sent, t.snapshot.name) == (2, 1, 14, "snap")
    assert isinstance(t.snapshot, S)
