"""Pulls from OCI registries: `pull(reference, name=..., platform=...)` and `apull` (asyncio).

`grove.Image.pull` is these with the Image class around the result (a one-line hook in images.py)."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from . import errors
from ._transport import default_async_client, default_client

PullCallback = Callable[[dict], None]


def _body(reference: str, name: Optional[str], platform: Optional[str]) -> dict:
    body: dict = {"reference": reference}
    if name is not None:
        body["name"] = name
    if platform is not None:
        body["platform"] = platform
    return body


def _sse(lines, on_event: PullCallback) -> Optional[dict]:
    """Feeds the stream's events to `on_event`; returns the image of `done`, raises on `error`."""
    kind, data = None, []
    for line in lines:
        if line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            ev = json.loads("\n".join(data))
            kind, data = kind or "message", []
            on_event(ev)
            if kind == "done":
                return ev["image"]
            if kind == "error":
                _raise(ev)
    return None


def _raise(ev: dict) -> None:
    msg, code, field = ev.get("message", "pull failed"), ev.get("code", "error"), ev.get("field")
    cls = {"image_not_found": errors.NotFound, "no_such_platform": errors.NotFound,
           "registry_unreachable": errors.Unavailable}.get(code, errors.ServerError)
    raise cls(msg, code=code, field=field)


def pull(reference: str, *, name: Optional[str] = None, platform: Optional[str] = None,
         on_event: Optional[PullCallback] = None, client: Any = None) -> dict:
    """Pulls `reference` (`[REGISTRY/]REPO[:TAG][@DIGEST]`) into the node's store as image `name`
    (default from the reference); `platform` (`os/arch`) picks from a multi-platform index. With
    `on_event`, each progress event (a dict with `status`) is passed to it as the layers stream.
    Returns the image (name, root, size_bytes, config)."""
    c = client or default_client()
    body = _body(reference, name, platform)
    if on_event is None:
        return c.request("POST", "/v1/images/pull", json=body, timeout=None).json()
    with c.stream("POST", "/v1/images/pull?stream=true", json=body, timeout=None) as r:
        if r.status_code >= 400:
            r.read()
            errors_raise(r)
        img = _sse(r.iter_lines(), on_event)
    if img is None:
        raise errors.ServerError("the pull's stream ended without a result")
    return img


async def apull(reference: str, *, name: Optional[str] = None, platform: Optional[str] = None,
                on_event: Optional[PullCallback] = None, client: Any = None) -> dict:
    """`pull` for asyncio."""
    c = client or default_async_client()
    body = _body(reference, name, platform)
    if on_event is None:
        return (await c.request("POST", "/v1/images/pull", json=body, timeout=None)).json()
    async with c.stream("POST", "/v1/images/pull?stream=true", json=body, timeout=None) as r:
        if r.status_code >= 400:
            await r.aread()
            errors_raise(r)
        lines = [line async for line in r.aiter_lines()]
    img = _sse(lines, on_event)
    if img is None:
        raise errors.ServerError("the pull's stream ended without a result")
    return img


def errors_raise(r) -> None:
    from ._transport import raise_for
    raise_for(r)
