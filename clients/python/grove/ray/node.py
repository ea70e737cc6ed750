"""Joins a Grove node to a Ray cluster: asks the local groved what it can hold, then runs `ray start` advertising
that as the `grove_slots` resource, with the node's labels (its groved labels, the images it has, whether it has a
GPU, the groved port) as Ray node labels, so that Ray's scheduler places sandboxes and groved stays the one that
admits them.

    python -m grove.ray.node --groved-url http://10.0.0.7:7070 --api-key-file /etc/grove/api-key \\
        --head --port 6379 --block           # or: --address <head>:6379

Everything after `--` goes to `ray start` as is."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional
from urllib.parse import urlparse

from .._transport import Client

SLOT = "grove_slots"
PREFIX = "grove.io/"
PORT_LABEL = PREFIX + "port"
GPU_LABEL = PREFIX + "gpu"
IMAGE_LABEL = PREFIX + "image."
_LABEL_VALUE = re.compile(r"^([a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?)?$")

# What one slot is worth when a node's memory, not its sandbox count, is what runs out first.
DEFAULT_SLOT_MEMORY_MB = 256


def slots(node: dict, slot_memory_mb: int = DEFAULT_SLOT_MEMORY_MB) -> int:
    """Sandboxes the node can hold: its sandbox limit, or fewer if its memory fills first."""
    total = node["capacity"]["total"]
    by_memory = total["memory_mb"] // slot_memory_mb if slot_memory_mb > 0 else total["sandboxes"]
    return max(0, min(total["sandboxes"], by_memory))


def has_gpu() -> bool:
    return any(Path("/dev").glob("nvidia[0-9]*")) or any(Path("/dev/dri").glob("renderD*"))


def labels(node: dict, images: List[str], port: int, gpu: bool) -> Dict[str, str]:
    """Ray node labels for a Grove node. groved labels keep their names under `grove.io/`; each image the node
    holds becomes `grove.io/image.<name>=cached`. Labels whose value Ray cannot carry are left out."""
    out = {PORT_LABEL: str(port), GPU_LABEL: "true" if gpu else "false"}
    for name in images:
        out[IMAGE_LABEL + name] = "cached"
    for k, v in node.get("labels", {}).items():
        out[PREFIX + k] = v
    return {k: v for k, v in out.items() if _LABEL_VALUE.match(v) and len(k.split("/")[-1]) <= 63}


def ray_start_args(groved_url: str, api_key: Optional[str], slot_memory_mb: int = DEFAULT_SLOT_MEMORY_MB,
                   extra: Optional[Dict[str, str]] = None) -> List[str]:
    """The `ray start` flags for this node (without the head/address part)."""
    with Client(base_url=groved_url, api_key=api_key) as c:
        node = c.request("GET", "/v1/node").json()
        images = [i["name"] for i in c.request("GET", "/v1/images").json()["items"]]
    port = urlparse(groved_url).port or 80
    lab = labels(node, images, port, has_gpu())
    lab.update(extra or {})
    resources = '{"%s": %d}' % (SLOT, slots(node, slot_memory_mb))
    return ["--resources", resources, "--labels", ",".join(f"{k}={v}" for k, v in sorted(lab.items())),
            "--num-cpus", "0"]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m grove.ray.node", description=__doc__.split("\n\n")[0])
    p.add_argument("--groved-url", required=True, help="this node's groved, as other nodes reach it")
    p.add_argument("--api-key-file")
    p.add_argument("--slot-memory-mb", type=int, default=DEFAULT_SLOT_MEMORY_MB)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--head", action="store_true")
    g.add_argument("--address", help="the Ray head, host:port")
    p.add_argument("--port", type=int, default=6379, help="GCS port (with --head)")
    p.add_argument("--block", action="store_true", help="stay in the foreground (for systemd)")
    a = p.parse_args(argv)
    key = Path(a.api_key_file).read_text().strip() if a.api_key_file else os.environ.get("GROVE_API_KEY")
    try:
        flags = ray_start_args(a.groved_url, key, a.slot_memory_mb)
    except Exception as e:  # one line, non-zero exit
        print(f"grove.ray.node: cannot read the node from {a.groved_url}: {e}", file=sys.stderr)
        return 1
    ray = str(Path(sys.executable).parent / "ray")
    cmd = [ray, "start", "--node-ip-address", urlparse(a.groved_url).hostname or "127.0.0.1", "--disable-usage-stats"]
    cmd += ["--head", "--port", str(a.port), "--include-dashboard=false"] if a.head else ["--address", a.address]
    cmd += flags + (["--block"] if a.block else []) + passthrough
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
