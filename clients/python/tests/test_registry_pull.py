"""grove.registry.pull without a daemon: the request it sends, the event stream it follows."""

import json

import httpx
import pytest

import grove
from grove import registry

FAST = grove.RetryPolicy(attempts=2, base_delay=0.001, max_delay=0.01)
IMAGE = {"name": "app-1", "root": "ab" * 32, "size_bytes": 10, "config": {"env": ["A=1"]}}


def client_with(handler):
    return grove.Client(base_url="http://test", retry=FAST, transport=httpx.MockTransport(handler))


def sse(*events):
    return "".join(f"event: {k}\ndata: {json.dumps(v)}\n\n" for k, v in events).encode()


def test_pull_posts_the_reference_and_returns_the_image():
    seen = []

    def handler(req):
        seen.append(json.loads(req.content))
        return httpx.Response(201, json=IMAGE)

    assert registry.pull("127.0.0.1:5000/ns/app:1", platform="linux/arm64", client=client_with(handler)) == IMAGE
    assert seen == [{"reference": "127.0.0.1:5000/ns/app:1", "platform": "linux/arm64"}]


def test_pull_streams_progress_then_the_image():
    def handler(req):
        assert req.url.params["stream"] == "true"
        body = sse(("progress", {"status": "resolved", "layers": 1}),
                   ("progress", {"status": "layer", "digest": "sha256:x", "cached": False}),
                   ("done", {"status": "done", "image": IMAGE}))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    events = []
    assert registry.pull("x", name="n", on_event=events.append, client=client_with(handler)) == IMAGE
    assert [e["status"] for e in events] == ["resolved", "layer", "done"]


def test_a_failed_layer_raises_with_the_servers_reason():
    def handler(req):
        body = sse(("error", {"status": "error", "code": "registry_unreachable", "field": "reference",
                              "message": "blob sha256:ab broke off"}))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    with pytest.raises(grove.Unavailable) as e:
        registry.pull("x", on_event=lambda _: None, client=client_with(handler))
    assert "sha256:ab" in str(e.value)


def test_an_unknown_reference_is_not_found():
    def handler(req):
        return httpx.Response(404, json={"code": "image_not_found", "message": "manifest ns/x:1 not found",
                                         "field": "reference"})

    with pytest.raises(grove.NotFound):
        registry.pull("h:1/ns/x:1", client=client_with(handler))
