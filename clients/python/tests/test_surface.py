"""The sync and asyncio clients have the same public surface: every operation on one exists on the other with
the same signature, async exactly where the sync one blocks."""

import inspect

import pytest

import grove

PAIRS = [
    (grove.Sandbox, grove.AsyncSandbox), (grove.Commands, grove.AsyncCommands), (grove.Files, grove.AsyncFiles),
    (grove.Process, grove.AsyncProcess), (grove.Snapshot, grove.AsyncSnapshot), (grove.Image, grove.AsyncImage),
    (grove.Lease, grove.AsyncLease),
]
# What differs by design: the context-manager protocol.
SYNC_ONLY = {"__enter__", "__exit__"}
ASYNC_ONLY = {"__aenter__", "__aexit__"}


def public(cls):
    return {n for n in dir(cls) if not n.startswith("_")}


@pytest.mark.parametrize("sync,asy", PAIRS, ids=[s.__name__ for s, _ in PAIRS])
def test_same_public_surface(sync, asy):
    assert public(sync) == public(asy), (public(sync) ^ public(asy))
    assert {n for n in SYNC_ONLY if hasattr(sync, n)} <= SYNC_ONLY
    for name in public(sync):
        s, a = inspect.getattr_static(sync, name), inspect.getattr_static(asy, name)
        assert type(s) is type(a), name  # both classmethods, properties or plain functions
        fs, fa = getattr(sync, name), getattr(asy, name)
        if not callable(fs) or isinstance(s, property):
            continue
        assert inspect.signature(fs) == inspect.signature(fa), name
        assert not inspect.iscoroutinefunction(fs), f"{sync.__name__}.{name} is async"
        blocking = getattr(fs, "_grove_op", False)
        assert inspect.iscoroutinefunction(fa) == blocking, f"{asy.__name__}.{name}: async iff it calls groved"


def test_sandbox_has_the_features():
    for name in ["create", "create_many", "connect", "list", "delete_many", "exec", "snapshot", "kill", "pause",
                 "resume", "usage", "set_timeout", "get_host", "refresh", "is_running"]:
        assert inspect.iscoroutinefunction(getattr(grove.AsyncSandbox, name)) or name == "get_host", name
    for name in ["read", "write", "upload", "download", "list", "stat", "exists", "make_dir", "remove", "rename",
                 "upload_tar", "download_tar", "upload_dir", "download_dir", "watch"]:
        assert hasattr(grove.AsyncFiles, name) and hasattr(grove.Files, name), name
    for name in ["list", "get", "fork", "delete", "export", "import_", "transfer", "pull"]:
        assert hasattr(grove.AsyncSnapshot, name), name
    for name in ["run", "start", "list", "connect", "kill"]:
        assert hasattr(grove.AsyncCommands, name), name
    for name in ["wait", "kill", "log", "is_running"]:
        assert hasattr(grove.AsyncProcess, name), name
    assert {"snapshot", "ports", "queue_timeout"} <= set(inspect.signature(grove.AsyncSandbox.create).parameters)


def test_clients_match():
    for name in ["request", "send"]:
        assert inspect.signature(getattr(grove.Client, name)) == inspect.signature(getattr(grove.AsyncClient, name))
        assert inspect.iscoroutinefunction(getattr(grove.AsyncClient, name))
