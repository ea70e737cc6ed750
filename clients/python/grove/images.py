"""Images on a node: `Image.list()`, `Image.import_(...)` (and `AsyncImage`). Pull and build hook in here."""

from __future__ import annotations

from typing import Any, BinaryIO, Iterable, Optional, Union

from ._api import invalid
from ._core import Call, Op, op, shell
from ._streams import ProgressCallback, _body, _q
from ._transport import default_async_client, default_client


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

    @op
    def delete(self) -> Op:
        yield Call(self._c, "DELETE", f"/v1/images/{_q(self.name)}", timeout=None)


class Image(shell(ImageCore, asynchronous=False)):  # type: ignore[misc]
    __doc__ = ImageCore.__doc__
    _default_client = staticmethod(default_client)


class AsyncImage(shell(ImageCore, asynchronous=True)):  # type: ignore[misc]
    __doc__ = ImageCore.__doc__
    _default_client = staticmethod(default_async_client)
