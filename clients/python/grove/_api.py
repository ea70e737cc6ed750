"""Request bodies and result types shared by the sync and async clients."""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from .errors import InvalidRequest

Network = Union[None, str, Sequence[Union[str, dict]]]


def invalid(field: str, message: str) -> InvalidRequest:
    """A bad argument, caught before anything is sent (so it has no side effect)."""
    return InvalidRequest(message, field=field, code="invalid_argument")


def _number(field: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v):
        raise invalid(field, f"{v!r} is not a number of seconds")
    return float(v)


def command_timeout_ms(field: str, v: Optional[float]) -> Optional[int]:
    """A command's deadline. None or 0: no limit (as in E2B); else seconds > 0, rounded up to a millisecond."""
    if v is None:
        return None
    t = _number(field, v)
    if t < 0:
        raise invalid(field, f"{v!r} is negative: give seconds > 0, or 0/None for no limit")
    return None if t == 0 else max(1, math.ceil(t * 1000))


def lifetime_secs(field: str, v: Optional[float]) -> Optional[int]:
    """A sandbox's or snapshot's lifetime in seconds (> 0, rounded up). None: the node's default. 0 is refused:
    an expiry of zero would destroy it at once; `set_timeout(None)` removes an expiry."""
    if v is None:
        return None
    t = _number(field, v)
    if t <= 0:
        raise invalid(field, f"{v!r}: give seconds > 0 (None: the node's default; set_timeout(None): no expiry)")
    return math.ceil(t)


def ttl_secs(field: str, v: Optional[float]) -> Optional[int]:
    """A sandbox's or snapshot's time to live at creation: seconds > 0 (rounded up); 0: no expiry (not even
    the node's default TTL); None: the node's default."""
    if v is not None and _number(field, v) == 0:
        return 0
    return lifetime_secs(field, v)


def positive_seconds(field: str, v: Optional[float]) -> Optional[float]:
    """A client-side wait (> 0 seconds); None: no limit."""
    if v is None:
        return None
    t = _number(field, v)
    if t <= 0:
        raise invalid(field, f"{v!r}: give seconds > 0, or None for no limit")
    return t


def queue_timeout_ms(v: Optional[float]) -> Optional[int]:
    """How long a create or fork may wait for room on a full node, in seconds (0: not at all, fail at once;
    None: the node's own queue timeout), at most an hour."""
    if v is None:
        return None
    t = _number("queue_timeout", v)
    if t < 0 or t > 3600:
        raise invalid("queue_timeout", f"{v!r}: give 0 to 3600 seconds (0 fails at once when the node is full)")
    return math.ceil(t * 1000)


def positive_int(field: str, v: Optional[int]) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise invalid(field, f"{v!r} is not a positive integer")
    return v


def cpu_millis(v: Optional[float]) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or math.isinf(v) or v <= 0:
        raise invalid("cpu", f"{v!r} is not a positive number of cores (0.5 = half a core)")
    return max(1, int(round(v * 1000)))


def ports_body(ports: Optional[Sequence[Union[int, Tuple[int, int], dict]]]) -> Optional[List[dict]]:
    """Published ports: `8080` (the same number outside), `(host_port, sandbox_port)` or a dict of both."""
    if ports is None:
        return None
    out = []
    for i, p in enumerate(ports):
        if isinstance(p, dict):
            host, inner = p.get("host_port"), p.get("sandbox_port")
        elif isinstance(p, (tuple, list)) and len(p) == 2:
            host, inner = p
        else:
            host = inner = p
        for v in (host, inner):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 65535:
                raise invalid(f"ports[{i}]", f"{p!r} is not a port (1-65535) or a (host_port, sandbox_port) pair")
        out.append({"host_port": host, "sandbox_port": inner})
    return out


def network_body(network: Network) -> Optional[dict]:
    """None → node default (offline); "none" → offline; a list of "CIDR[:port,port]" or {cidr, ports} → egress."""
    if network is None:
        return None
    if isinstance(network, str):
        if network == "none":
            return {"mode": "none"}
        network = [network]
    allow = []
    for rule in network:
        if isinstance(rule, dict):
            allow.append({"cidr": rule["cidr"], "ports": list(rule.get("ports", []))})
            continue
        cidr, ports = rule, []
        if ":" in rule and ("/" in rule.split(":")[0] or rule.count(":") == 1):
            cidr, p = rule.rsplit(":", 1)
            ports = [int(x) for x in p.split(",") if x]
        allow.append({"cidr": cidr, "ports": ports})
    return {"mode": "egress", "allow": allow}


def create_body(*, image: Optional[str] = None, snapshot: Optional[str] = None, cpu: Optional[float] = None,
                memory_mb: Optional[int] = None, disk_mb: Optional[int] = None, pids: Optional[int] = None,
                timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
                labels: Optional[Dict[str, str]] = None, network: Network = None, hostname: Optional[str] = None,
                workdir: Optional[str] = None, count: Optional[int] = None, idle_timeout: Optional[float] = None,
                on_idle: Optional[str] = None, job: Optional[str] = None, priority: Optional[int] = None,
                ports: Optional[Sequence[Any]] = None, queue_timeout: Optional[float] = None,
                userns: Optional[bool] = None) -> dict:
    """The POST /v1/sandboxes body; every argument checked here first, in the caller's terms."""
    body: Dict[str, Any] = {}
    if userns is not None:
        if not isinstance(userns, bool):
            raise invalid("userns", f"{userns!r} is not a bool")
        if userns:
            body["userns"] = True
    if job is not None:
        body["job"] = job
    if priority is not None:
        body["priority"] = priority
    if image is not None:
        body["image"] = image
    if snapshot is not None:
        body["snapshot"] = snapshot
    limits: Dict[str, Any] = {}
    for k, v in (("cpu_millis", cpu_millis(cpu)), ("memory_mb", positive_int("memory_mb", memory_mb)),
                 ("disk_mb", positive_int("disk_mb", disk_mb)), ("pids", positive_int("pids", pids))):
        if v is not None:
            limits[k] = v
    if limits:
        body["limits"] = limits
    ttl = ttl_secs("timeout", timeout)
    if ttl is not None:
        body["ttl_secs"] = ttl
    idle = lifetime_secs("idle_timeout", idle_timeout)
    if idle is not None:
        body["idle_timeout_secs"] = idle
    if count is not None:
        positive_int("count", count)
    p = ports_body(ports)
    if p:
        body["ports"] = p
    qt = queue_timeout_ms(queue_timeout)
    if qt is not None:
        body["queue_timeout_ms"] = qt
    if on_idle is not None:
        body["on_idle"] = on_idle
    if env:
        body["env"] = dict(env)
    if labels:
        body["labels"] = dict(labels)
    n = network_body(network)
    if n is not None:
        body["network"] = n
    if hostname is not None:
        body["hostname"] = hostname
    if workdir is not None:
        body["workdir"] = workdir
    if count is not None:
        body["count"] = count
    return body


def exec_body(cmd: Union[str, Sequence[str]], *, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
              cwd: Optional[str] = None, stdin: Union[None, str, bytes] = None, with_encoding: bool = True,
              user: Optional[str] = None) -> dict:
    body: Dict[str, Any] = {}
    if isinstance(cmd, str):
        body["shell"] = cmd
    else:
        body["argv"] = list(cmd)
    ms = command_timeout_ms("timeout", timeout)
    if ms is not None:
        body["timeout_ms"] = ms
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        body["stdin"] = base64.b64encode(data).decode()
    if with_encoding:
        body["encoding"] = "base64"
    return body


def http_timeout(command_timeout: Optional[float]) -> Optional[float]:
    """How long to wait for an answer: the command's own timeout plus slack; no limit when it has none. Past
    it the client closes the connection, which ends the command in the sandbox."""
    return None if not command_timeout else command_timeout + 30.0


@dataclass
class ExecResult:
    """What a command did. A non-zero exit is a result, not an exception."""

    stdout_bytes: bytes
    stderr_bytes: bytes
    exit_code: Optional[int]
    signal: Optional[int]
    timed_out: bool
    duration_ms: int

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def _decode(s: str, encoding: str) -> bytes:
    return base64.b64decode(s) if encoding == "base64" else s.encode()


def parse_exec(d: dict, stdout: bytes = b"", stderr: bytes = b"") -> ExecResult:
    enc = d.get("encoding", "utf8")
    return ExecResult(
        stdout_bytes=stdout + _decode(d.get("stdout", ""), enc),
        stderr_bytes=stderr + _decode(d.get("stderr", ""), enc),
        exit_code=d.get("exit_code"),
        signal=d.get("signal"),
        timed_out=bool(d.get("timed_out")),
        duration_ms=int(d.get("duration_ms", 0)),
    )


@dataclass
class EntryInfo:
    name: str
    path: str
    type: str
    size: int
    mode: int


def parse_entries(d: dict) -> List[EntryInfo]:
    base = d["path"].rstrip("/")
    return [EntryInfo(e["name"], f"{base}/{e['name']}", e["kind"], e["size"], e["mode"]) for e in d["entries"]]


@dataclass
class SandboxInfo:
    id: str
    state: str
    image: str
    hostname: str
    labels: Dict[str, str] = field(default_factory=dict)
    created_at_ms: int = 0
    expires_at_ms: Optional[int] = None
    raw: Dict[str, Any] = field(default_factory=dict)
    job: str = "default"

    @classmethod
    def from_json(cls, d: dict) -> "SandboxInfo":
        return cls(d["id"], d["state"], d["image"], d["hostname"], dict(d.get("labels") or {}),
                   d.get("created_at_ms", 0), d.get("expires_at_ms"), d, d.get("job") or "default")


def batch_split(d: dict) -> Tuple[List[dict], List[dict]]:
    """(sandboxes made, errors) of a batch answer."""
    ok = [r["sandbox"] for r in d["results"] if r.get("sandbox")]
    bad = [r["error"] for r in d["results"] if r.get("error")]
    return ok, bad


def list_params(labels: Optional[Dict[str, str]], state: Optional[str], token: Optional[str]) -> List[Tuple[str, str]]:
    p = [("limit", "1000")]
    for k, v in (labels or {}).items():
        p.append(("label", f"{k}={v}"))
    if state:
        p.append(("state", state))
    if token:
        p.append(("page_token", token))
    return p


class SseParser:
    """Turns text lines of a Server-Sent Events stream into (event, data) pairs."""

    def __init__(self) -> None:
        self.event = "message"
        self.data: List[str] = []

    def feed(self, line: str) -> Optional[Tuple[str, Any]]:
        if line == "":
            if not self.data:
                self.event = "message"
                return None
            out = (self.event, json.loads("\n".join(self.data)))
            self.event, self.data = "message", []
            return out
        if line.startswith("event:"):
            self.event = line[6:].strip()
        elif line.startswith("data:"):
            v = line[5:]
            self.data.append(v[1:] if v.startswith(" ") else v)
        return None


def sse_pairs(lines: Iterable[str]) -> Iterator[Tuple[str, Any]]:
    p = SseParser()
    for line in lines:
        got = p.feed(line)
        if got is not None:
            yield got
