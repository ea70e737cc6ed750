"""A groved serving the E2B-compatible endpoint (--e2b-listen style config key on a free loopback
port, with an API key), for the tests that drive it through the unmodified `e2b` SDK. Each test
gets E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY pointed at it; the daemon's teardown asserts a
clean exit and zero residue."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def e2b_node():
    from conftest import Daemon

    d = Daemon("e2b", e2b=True)
    d.import_base_image()
    yield d
    with d.http() as c:
        left = c.get("/v1/sandboxes").json()["items"]
    d.stop()
    assert left == [], f"sandboxes left behind by the E2B tests: {left}"


@pytest.fixture
def e2b_env(e2b_node, monkeypatch):
    url = f"http://{e2b_node.e2b}"
    monkeypatch.setenv("E2B_API_URL", url)
    monkeypatch.setenv("E2B_SANDBOX_URL", url)
    monkeypatch.setenv("E2B_API_KEY", e2b_node.api_key)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return e2b_node
