"""Sandboxes across many Grove nodes, placed by Ray.

Each node advertises `grove_slots` (see `grove.ray.node`). A sandbox holds one slot through a Ray placement group
for as long as it lives (a one-bundle group of its own, or a bundle of a block: see `lease.py`): Ray's scheduler
picks the node (free slots, label selectors, spread), then the sandbox is created by direct HTTP to that node's
groved. groved's own admission stays authoritative: a node that
answers 429 (or cannot be reached) gets its leases back and the sandboxes are placed again, elsewhere."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Set, Tuple

import ray

from .. import errors
from .._api import batch_split, create_body
from .._transport import Client, RetryPolicy, idempotency_headers
from ..sandbox import DEFAULT_IMAGE, Sandbox, Snapshot, Transfer, _q
from .lease import Leases, Slot
from .node import IMAGE_LABEL, PORT_LABEL, PREFIX, SLOT

NODE_ID_LABEL = "ray.io/node-id"
# groved's answers that mean "not here, try another node".
_REFUSALS = ("capacity_exceeded", "unavailable", "draining")


@dataclass(frozen=True)
class FleetNode:
    node_id: str
    url: str
    labels: Dict[str, str]  # groved's labels, without the grove.io/ prefix
    slots: float
    ray_labels: Dict[str, str] = field(default_factory=dict)


@dataclass
class Placement:
    """Where the sandboxes of one call went, and what it took."""
    per_node: Dict[str, int] = field(default_factory=dict)
    refusals: List[Tuple[str, str]] = field(default_factory=list)  # (node id, error code)


class FleetSandbox(Sandbox):
    """A `grove.Sandbox` bound to its node's groved, holding one Ray slot until it is killed."""

    def __init__(self, info: dict, client: Client, fleet: "Fleet", node_id: str):
        super().__init__(info, client)
        self.fleet = fleet
        self.node_id = node_id

    def kill(self) -> None:
        try:
            super().kill()
        finally:
            self.fleet._release(self.id)

    def snapshot(self, name: Optional[str] = None, stop: bool = False) -> "FleetSnapshot":
        s = super().snapshot(name, stop)
        return FleetSnapshot(s.info, self._c, self.node_id)


class FleetSnapshot(Snapshot):
    """A snapshot and the node that holds it."""

    def __init__(self, info: dict, client: Client, node_id: str):
        super().__init__(info, client)
        self.node_id = node_id


class Fleet:
    """Sandboxes on a Ray cluster of Grove nodes.

        fleet = Fleet(address="auto")
        sbxs = fleet.create(image="debian12", count=8, labels={"pool": "rl"})
        snap = sbxs[0].snapshot()
        branches = fleet.fork(snap, 16)          # on any nodes; the snapshot moves as a delta where needed
    """

    def __init__(self, address: str = "auto", *, api_key: Optional[str] = None, place_timeout: float = 10.0,
                 strategy: str = "SPREAD", block: int = 1):
        """`block` > 1 takes slots from Ray that many at a time and hands them out locally (see `lease.Leases`)."""
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        self.api_key = api_key
        self.place_timeout = place_timeout
        self.strategy = strategy
        self.transfers: List[Transfer] = []
        self._lock = threading.Lock()
        self._slots = Leases(block, place_timeout)
        self._leases: Dict[str, Slot] = {}
        self._clients: Dict[str, Tuple[str, Client, Client]] = {}  # node id -> (url, client, no-retry client)

    # --- the cluster ------------------------------------------------------------------------------------------
    def nodes(self) -> List[FleetNode]:
        """Live Ray nodes that carry a groved."""
        out = []
        for n in ray.nodes():
            lab = n.get("Labels") or {}
            if not n.get("Alive") or PORT_LABEL not in lab or SLOT not in n.get("Resources", {}):
                continue
            url = f"http://{n['NodeManagerAddress']}:{lab[PORT_LABEL]}"
            grove_labels = {k[len(PREFIX):]: v for k, v in lab.items() if k.startswith(PREFIX)}
            out.append(FleetNode(n["NodeID"], url, grove_labels, n["Resources"][SLOT], dict(lab)))
        return out

    def client(self, node_id: str) -> Client:
        return self._node(node_id)[1]

    def _node(self, node_id: str) -> Tuple[str, Client, Client]:
        with self._lock:
            c = self._clients.get(node_id)
        if c is None:
            node = next((n for n in self.nodes() if n.node_id == node_id), None)
            if node is None:
                raise errors.Unavailable(f"Ray node {node_id} is gone or runs no groved", code="node_lost")
            c = (node.url, Client(base_url=node.url, api_key=self.api_key),
                 Client(base_url=node.url, api_key=self.api_key, retry=RetryPolicy(attempts=1)))
            with self._lock:
                self._clients.setdefault(node_id, c)
        return c

    def sandboxes(self) -> List[str]:
        with self._lock:
            return list(self._leases)

    def node_of(self, sandbox_id: str) -> Optional[str]:
        with self._lock:
            lease = self._leases.get(sandbox_id)
        return lease.node_id if lease else None

    def lost(self) -> List[str]:
        """Sandboxes whose node has left the cluster (its raylet died): they are gone with it. Their slots are
        given back (Ray would otherwise hold them on another node) and they are forgotten."""
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        self._slots.node_died(alive)
        with self._lock:
            gone = [sid for sid, lease in self._leases.items() if lease.node_id not in alive]
            leases = [self._leases.pop(sid) for sid in gone]
            dead = [self._clients.pop(n) for n in list(self._clients) if n not in alive]
        for lease in leases:
            lease.release()
        for _, a, b in dead:
            a.close()
            b.close()
        return gone

    def reap(self) -> List[str]:
        """Sandboxes that ended on a live node without this fleet killing them (their TTL ran out, someone deleted
        them directly): their slots are given back. One listing per node that holds leases."""
        with self._lock:
            by_node: Dict[str, Set[str]] = {}
            for sid, lease in self._leases.items():
                by_node.setdefault(lease.node_id, set()).add(sid)
        gone: List[str] = []
        for node, sids in by_node.items():
            try:
                live = {s.id for s in Sandbox.list(client=self._node(node)[2])}
            except errors.GroveError:
                continue  # unreachable now: whether the node is lost is lost()'s call
            gone += sorted(sids - live)
        for sid in gone:
            self._release(sid)
        return gone

    # --- sandboxes ------------------------------------------------------------------------------------------
    def create(self, image: str = DEFAULT_IMAGE, *, count: int = 1, labels: Optional[Dict[str, str]] = None,
               on: Optional[str] = None, strategy: Optional[str] = None, **create_kw) -> List[FleetSandbox]:
        """`count` sandboxes of `image` on nodes that hold the image and match `labels` (groved node labels;
        `on` pins a Ray node id). Other keywords are those of `Sandbox.create`. Raises CapacityExceeded when the
        fleet has no room (nothing is left behind)."""
        selector = self._selector(labels, on)
        selector[IMAGE_LABEL + image] = "cached"

        def make(client: Client, k: int) -> dict:
            body = create_body(image=image, count=k, **create_kw)
            return client.request("POST", "/v1/sandboxes", json=body, headers=idempotency_headers()).json()

        return self._spawn(count, selector, strategy, make, None)

    def fork(self, snapshot: FleetSnapshot, n: int = 1, *, labels: Optional[Dict[str, str]] = None,
             on: Optional[str] = None, strategy: Optional[str] = None, timeout: Optional[float] = None
             ) -> List[FleetSandbox]:
        """`n` branches of `snapshot` wherever Ray finds slots; a node that lacks the snapshot first receives it
        as a delta (only the objects it does not hold; see `self.transfers`)."""
        selector = self._selector(labels, on)
        body: dict = {}
        if timeout is not None:
            body["ttl_secs"] = max(1, int(timeout))

        def make(client: Client, k: int) -> dict:
            return client.request("POST", f"/v1/snapshots/{_q(snapshot.name)}/fork", json={**body, "count": k},
                                  headers=idempotency_headers()).json()

        return self._spawn(n, selector, strategy, make, snapshot)

    def close(self) -> None:
        """Gives back every slot this fleet holds (the sandboxes keep running until their TTL or a kill)."""
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
            clients, self._clients = list(self._clients.values()), {}
        for lease in leases:
            lease.release()
        self._slots.close()
        for _, a, b in clients:
            a.close()
            b.close()
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- placement ------------------------------------------------------------------------------------------
    @staticmethod
    def _selector(labels: Optional[Dict[str, str]], on: Optional[str]) -> Dict[str, str]:
        sel = {PREFIX + k: v for k, v in (labels or {}).items()}
        if on:
            sel[NODE_ID_LABEL] = on
        return sel

    def _spawn(self, count: int, selector: Dict[str, str], strategy: Optional[str], make, snapshot
               ) -> List[FleetSandbox]:
        if count < 1:
            raise errors.InvalidRequest("count must be at least 1", field="count")
        self.lost()
        if ray.available_resources().get(SLOT, 0) < count:
            self.reap()
        self.last_placement = placement = Placement()
        made: List[FleetSandbox] = []
        refused: Set[str] = set()
        want = count
        reaped = False
        try:
            while want > 0:
                try:
                    leases = self._place(want, selector, strategy, refused)
                except errors.CapacityExceeded:
                    if reaped or not self.reap():
                        raise
                    reaped = True  # slots of sandboxes that ended by themselves came back: one more try
                    continue
                by_node: Dict[str, List[Slot]] = {}
                for slot in leases:
                    by_node.setdefault(slot.node_id, []).append(slot)
                # One batch per node, all nodes at once; every batch finishes (and records what it made)
                # before the first failure is raised, so nothing made is left untracked.
                with ThreadPoolExecutor(max_workers=len(by_node)) as pool:
                    futs = [pool.submit(self._fill, node, slots, make, snapshot, placement, refused)
                            for node, slots in by_node.items()]
                    wait(futs)
                for f in futs:
                    if f.exception() is None:
                        made += f.result()
                        want -= len(f.result())
                for f in futs:
                    if f.exception() is not None:
                        raise f.exception()
        except BaseException:
            for s in made:
                try:
                    s.kill()
                except errors.GroveError:
                    pass
            raise
        return made

    def _place(self, count: int, selector: Dict[str, str], strategy: Optional[str], avoid: Set[str]
               ) -> List[Slot]:
        """`count` one-slot leases; all or none."""
        sel = dict(selector)
        if avoid:
            if NODE_ID_LABEL in sel:
                raise errors.CapacityExceeded(f"node {sel[NODE_ID_LABEL]} refused the sandboxes", code="capacity_exceeded")
            sel[NODE_ID_LABEL] = "!in(" + ",".join(sorted(avoid)) + ")"
        matching = {n.node_id for n in self.nodes() if _matches(n, sel)}
        room = sum(n.slots for n in self.nodes() if n.node_id in matching)
        if room < count:
            raise errors.CapacityExceeded(
                f"the live nodes matching {selector} have {room:g} {SLOT} in all, fewer than {count}"
                f"{' (refused by ' + ', '.join(sorted(avoid)) + ')' if avoid else ''}", status=429,
                code="capacity_exceeded")
        return self._slots.acquire(count, sel, strategy or self.strategy, lambda node: node in matching)

    def _fill(self, node: str, slots: List[Slot], make, snapshot, placement: Placement,
              refused: Set[str]) -> List[FleetSandbox]:
        """Creates len(slots) sandboxes on `node`, each holding one slot; slots it refuses are given back and the
        node is avoided from then on in this call."""
        try:
            url, client, once = self._node(node)
            if snapshot is not None and snapshot.node_id != node:
                self._ensure_snapshot(snapshot, client)
            made, bad = batch_split(make(once, len(slots)))
        except (errors.CapacityExceeded, errors.Unavailable, errors.ConnectionFailed) as e:
            made, bad = [], [{"code": e.code or "unavailable"}] * len(slots)
        except BaseException:
            for slot in slots:
                slot.release()
            raise
        out = []
        for info, slot in zip(made, slots):
            with self._lock:
                self._leases[info["id"]] = slot
            out.append(FleetSandbox(info, client, self, node))
        failure = None
        for e, slot in zip(bad, slots[len(made):]):
            slot.release()
            if e.get("code") in _REFUSALS:
                placement.refusals.append((node, e.get("code", "")))
                refused.add(node)
            elif failure is None:
                failure = errors.GroveError(f"node {node}: {e.get('message')}", code=e.get("code"))
        if failure is not None:
            for s in out:
                s.kill()
            raise failure
        if out:
            placement.per_node[node] = placement.per_node.get(node, 0) + len(out)
        return out

    def _ensure_snapshot(self, snapshot: FleetSnapshot, target: Client) -> None:
        """The target node pulls the snapshot from its node unless it has it: only missing objects move."""
        try:
            target.request("GET", f"/v1/snapshots/{_q(snapshot.name)}")
        except errors.NotFound:
            source = self._node(snapshot.node_id)[0]
            try:
                self.transfers.append(Snapshot.pull(snapshot.name, source, client=target,
                                                    source_api_key=self.api_key))
            except errors.Conflict:
                pass  # another call brought it meanwhile

    def _release(self, sandbox_id: str) -> None:
        with self._lock:
            lease = self._leases.pop(sandbox_id, None)
        if lease is not None:
            lease.release()


def _matches(node: FleetNode, selector: Dict[str, str]) -> bool:
    """Whether a node's labels satisfy a Ray label selector of exact values and `!in(...)` (what Fleet builds)."""
    for k, want in selector.items():
        have = node.node_id if k == NODE_ID_LABEL else node.ray_labels.get(k)
        if want.startswith("!in(") and want.endswith(")"):
            if have in want[4:-1].split(","):
                return False
        elif have != want:
            return False
    return True


def spread(sandboxes: Iterable[FleetSandbox]) -> Dict[str, int]:
    """Sandboxes per node id."""
    out: Dict[str, int] = {}
    for s in sandboxes:
        out[s.node_id] = out.get(s.node_id, 0) + 1
    return out
