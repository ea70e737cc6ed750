"""Images on a node: `Image.list()`, `import_`, `pull` (an OCI registry) and `build` (a Dockerfile), and `AsyncImage`."""

from __future__ import annotations

from typing import Any, BinaryIO, Callable, Dict, Iterable, Optional, Union

from ._api import invalid
from ._core import Call, Op, op, shell
from ._streams import ProgressCallback, _body, _Events, _q
from ._transport import default_async_client, default_client
from . import errors
from .build import context_tar


class ImageCore:
    """A root filesystem sandboxes are created from."""

    _default_client: Any

    def __init__(self, info: dict, client: Any = None):
        self._c = client or type(self)._default_client()
        self.info = info

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def size_bytes(self) -> Optional[int]:
        return self.info.get("size_bytes")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @classmethod
    @op
    def list(cls, client: Any = None) -> Op:
        c = client or cls._default_client()
        return [cls(i, c) for i in (yield Call(c, "GET", "/v1/images")).json()["items"]]

    @classmethod
    @op
    def get(cls, name: str, client: Any = None) -> Op:
        for i in (yield from ImageCore.list.__func__(cls, client)):  # type: ignore[attr-defined]
            if i.name == name:
                return i
        from .errors import NotFound
        raise NotFound(f"no image {name!r}", code="not_found", field="name")

    @classmethod
    @op
    def import_(cls, name: str, path: str, *, source: str = "dir", reference: Optional[str] = None,
                client: Any = None) -> Op:
        """Imports the root directory (`source="dir"`) or OCI image layout (`"oci"`, `reference` inside it)
        at `path` on the node as image `name`."""
        if source not in ("dir", "oci"):
            raise invalid("source", f"{source!r}: give \"dir\" or \"oci\"")
        c = client or cls._default_client()
        body = {"name": name, "source": source, "path": path}
        if reference is not None:
            body["reference"] = reference
        return cls((yield Call(c, "POST", "/v1/images", json=body, timeout=None)).json(), c)

    @classmethod
    @op
    def import_tar(cls, name: str, tar: Union[bytes, BinaryIO, Iterable[bytes]], *, client: Any = None,
                   on_progress: Optional[ProgressCallback] = None) -> Op:
        """Imports a tar of a root filesystem (bytes, an open file or chunks, streamed) as image `name`."""
        c = client or cls._default_client()
        r = yield Call(c, "PUT", f"/v1/images/{_q(name)}/tar", content=_body(tar, on_progress),
                       headers={"content-type": "application/x-tar"}, timeout=None)
        return cls(r.json(), c)

    @classmethod
    @op
    def pull(cls, reference: str, *, name: Optional[str] = None, platform: Optional[str] = None,
             on_event: Optional[Callable[[dict], None]] = None, client: Any = None) -> Op:
        """Pulls `reference` (`[REGISTRY/]REPO[:TAG][@DIGEST]`) from an OCI registry into the node's store as image
        `name` (default from the reference); `platform` (`os/arch`) picks from a multi-platform index. `on_event`
        gets each progress event (a dict with `status`) as the layers stream in."""
        c = client or cls._default_client()
        body: Dict[str, Any] = {"reference": reference}
        if name is not None:
            body["name"] = name
        if platform is not None:
            body["platform"] = platform
        if on_event is None:
            return cls((yield Call(c, "POST", "/v1/images/pull", json=body, timeout=None)).json(), c)
        ev = _Events(lambda _kind, data: on_event(data))
        yield Call(c, "POST", "/v1/images/pull", params={"stream": "true"}, json=body, timeout=None, sink=ev,
                   idempotent=False)
        return cls(_final(ev, "pull"), c)

    @classmethod
    @op
    def build(cls, context: str, tag: str, *, dockerfile: str = "Dockerfile",
              build_args: Optional[Dict[str, str]] = None, allow: Optional[Iterable[str]] = None,
              on_log: Optional[Callable[[str], None]] = None, client: Any = None) -> Op:
        """Builds image `tag` from the directory `context` and its Dockerfile (`.dockerignore` applied).

        `allow`: egress for RUN steps, CIDR[:PORT,...] each (default: no network). `on_log` gets each step line
        and the RUN output as text. A Dockerfile error raises InvalidRequest naming the line; a failed step
        raises GroveError naming the step and line (code "build_failed")."""
        c = client or cls._default_client()
        params = [("name", tag), ("dockerfile", dockerfile)]
        params += [("build_arg", f"{k}={v}") for k, v in (build_args or {}).items()]
        params += [("allow", a) for a in (allow or [])]

        def log(kind: str, data: Any) -> None:
            if on_log is None:
                return
            if kind == "step":
                cached = " (cached)" if data.get("cached") else ""
                on_log(f"STEP {data['step']}/{data['total']}: {data['instruction']}{cached}\n")
            elif kind == "output":
                on_log(data.get("data", ""))

        ev = _Events(log)
        yield Call(c, "POST", "/v1/images/build", params=params, content=context_tar(context, dockerfile),
                   headers={"content-type": "application/x-tar"}, timeout=None, sink=ev, idempotent=False)
        return cls(_final(ev, "build"), c)

    @op
    def delete(self) -> Op:
        yield Call(self._c, "DELETE", f"/v1/images/{_q(self.name)}", timeout=None)


class Image(shell(ImageCore, asynchronous=False)):  # type: ignore[misc]
    __doc__ = ImageCore.__doc__
    _default_client = staticmethod(default_client)


class AsyncImage(shell(ImageCore, asynchronous=True)):  # type: ignore[misc]
    __doc__ = ImageCore.__doc__
    _default_client = staticmethod(default_async_client)


def _final(ev: _Events, what: str) -> dict:
    """The image of a pull's or build's `done` event; its `error` event raised as the error it names."""
    if ev.last is None:
        raise errors.ConnectionLost(f"the {what}'s stream ended without a result", code="connection_lost")
    kind, data = ev.last
    if kind == "error":
        raise errors.from_response(_ERROR_STATUS.get(data.get("code"), 422), data)
    return data["image"]


#: The status an `error` event's code stands for (the stream itself answered 200).
_ERROR_STATUS = {"image_not_found": 404, "no_such_platform": 404, "registry_unreachable": 503,
                 "insufficient_storage": 507}
