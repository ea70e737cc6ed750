"""Image builds from Dockerfiles (POST /v1/images/build): the context goes up as a tar, the log comes back
as it runs.

    from grove.build import build_image
    img = build_image("./task", "task-env", build_args={"V": "1"}, on_log=print)
"""

from __future__ import annotations

import fnmatch
import io
import os
import tarfile
from typing import Any, Callable, Dict, Iterable, Optional



def _ignored(rules, rel: str) -> bool:
    """`.dockerignore` semantics, closely enough for the upload (the server applies the file again)."""
    out = False
    parts = rel.split("/")
    for neg, pat in rules:
        if any(fnmatch.fnmatchcase("/".join(parts[:n]), pat) for n in range(1, len(parts) + 1)):
            out = not neg
    return out


def context_tar(context: str, dockerfile: str = "Dockerfile") -> bytes:
    """The context as a tar, less what its `.dockerignore` leaves out (never the Dockerfile itself)."""
    rules = []
    try:
        with open(os.path.join(context, ".dockerignore")) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    neg = line.startswith("!")
                    rules.append((neg, line.lstrip("!").strip().strip("/").removeprefix("./")))
    except FileNotFoundError:
        pass
    buf = io.BytesIO()
    keep = {dockerfile.strip("/"), ".dockerignore"}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as t:
        for root, dirs, files in os.walk(context):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(root, name)
                rel = os.path.relpath(full, context)
                if rel not in keep and _ignored(rules, rel):
                    if name in dirs:
                        dirs.remove(name)
                    continue
                if name in dirs and os.path.islink(full):
                    dirs.remove(name)
                t.add(full, arcname=rel, recursive=False)
    return buf.getvalue()


def build_image(context: str, tag: str, *, dockerfile: str = "Dockerfile",
                build_args: Optional[Dict[str, str]] = None, allow: Optional[Iterable[str]] = None,
                on_log: Optional[Callable[[str], None]] = None, client: Any = None) -> dict:
    """`grove.Image.build(...).info`: builds image `tag` from `context`; returns the image (name, root, config)."""
    from .images import Image

    return Image.build(context, tag, dockerfile=dockerfile, build_args=build_args, allow=allow, on_log=on_log,
                       client=client).info
