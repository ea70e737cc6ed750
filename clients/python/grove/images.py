"""Images on the node: `Image.build` makes one from a Dockerfile (see grove.build)."""

from __future__ import annotations

from .build import build_image


class Image:
    """Image operations; `Image.build(context, tag, ...)` returns the built image as a dict."""

    build = staticmethod(build_image)
