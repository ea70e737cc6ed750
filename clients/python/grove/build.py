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
from typing import Callable, Dict, Iterable, Optional

from . import errors
from ._api import sse_pairs
from ._transport import Client, default_client


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
                on_log: Optional[Callable[[str], None]] = None, client: Optional[Client] = None,
                timeout: float = 3600) -> dict:
    """Builds image `tag` from `context` (a directory); returns the image (name, root, config).

    `allow`: egress for RUN steps, CIDR[:PORT,...] each (default: no network). `on_log` gets each step line and
    the RUN output as text. A Dockerfile error raises InvalidRequest naming the line; a failed step raises
    GroveError naming the step and line (code "build_failed")."""
    c = client or default_client()
    params = [("name", tag), ("dockerfile", dockerfile)]
    params += [("build_arg", f"{k}={v}") for k, v in (build_args or {}).items()]
    params += [("allow", a) for a in (allow or [])]
    body = context_tar(context, dockerfile)
    with c._http.stream("POST", "/v1/images/build", params=params, content=body,
                        headers={"content-type": "application/x-tar"}, timeout=timeout) as r:
        if not r.is_success:
            r.read()
            raise errors.from_response(r.status_code, r.json())
        for event, data in sse_pairs(r.iter_lines()):
            if event == "step" and on_log:
                cached = " (cached)" if data.get("cached") else ""
                on_log(f"STEP {data['step']}/{data['total']}: {data['instruction']}{cached}\n")
            elif event == "output" and on_log:
                on_log(data.get("data", ""))
            elif event == "done":
                return data["image"]
            elif event == "error":
                raise errors.from_response(507 if data.get("code") == "insufficient_storage" else 422, data)
    raise errors.ServerError("the build's log ended without a result")
