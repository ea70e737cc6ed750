"""Holding `grove_slots` through Ray placement groups: a slot a sandbox holds while it lives.

With `block=1` every slot is its own one-bundle placement group: Ray's view is exact, and every create or kill is
one operation on Ray's GCS (which is the fleet's bottleneck at scale, see docs/fleet.md). With `block=k` a
placement group of up to k bundles is taken at once and its slots are handed out here; the group is given back
when all its slots are free. That divides the GCS operations by up to k, at the price of free slots held idle
inside this driver's blocks (other drivers cannot use them)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Set

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

from .. import errors
from .node import SLOT


class _Block:
    def __init__(self, pg: PlacementGroup, nodes: List[str]):
        self.pg = pg
        self.nodes = nodes  # node id of each bundle
        self.free: Set[int] = set(range(len(nodes)))
        self.tainted = False  # a bundle's node died: Ray may move bundles, so hand out nothing more from here


class Slot:
    """One slot on `node_id`; `release()` gives it back (idempotent)."""

    def __init__(self, leases: "Leases", block: _Block, index: int):
        self._leases, self._block, self._index = leases, block, index
        self.node_id = block.nodes[index]
        self._released = False

    def release(self) -> None:
        self._leases._free(self)


class Leases:
    def __init__(self, block: int = 1, place_timeout: float = 10.0):
        if block < 1:
            raise ValueError("block must be at least 1")
        self.block = block
        self.place_timeout = place_timeout
        self.groups_created = 0  # placement groups asked of Ray, for measuring
        self._lock = threading.RLock()
        self._blocks: List[_Block] = []

    def acquire(self, count: int, selector: Dict[str, str], strategy: str, usable: Callable[[str], bool]
                ) -> List[Slot]:
        """`count` slots on nodes matching `selector` (Ray's label selector) for which `usable(node id)` holds;
        all or none. Raises CapacityExceeded."""
        with self._lock:
            got: List[Slot] = []
            # Free slots of held blocks first, always from the block and node with the most free (a spread).
            while len(got) < count:
                cands = [(b, i) for b in self._blocks if not b.tainted for i in b.free if usable(b.nodes[i])]
                if not cands:
                    break
                per_node: Dict[str, int] = {}
                for b, i in cands:
                    per_node[b.nodes[i]] = per_node.get(b.nodes[i], 0) + 1
                b, i = max(cands, key=lambda c: per_node[c[0].nodes[c[1]]])
                b.free.discard(i)
                got.append(Slot(self, b, i))
            need = count - len(got)
            if need:
                try:
                    got += self._new(need, selector, strategy)
                except errors.CapacityExceeded:
                    for s in got:
                        self._free(s)
                    raise
            return got

    def _new(self, need: int, selector: Dict[str, str], strategy: str) -> List[Slot]:
        if self.block == 1:
            sizes = [1] * need
        else:
            spare = int(ray.available_resources().get(SLOT, 0))
            sizes = [max(need, min(self.block, spare))]
        groups = [placement_group([{SLOT: 1}] * n, strategy=strategy, bundle_label_selector=[selector] * n)
                  for n in sizes]
        self.groups_created += len(groups)
        deadline = time.monotonic() + self.place_timeout
        ok = [pg.wait(max(0.0, deadline - time.monotonic())) for pg in groups]
        if not all(ok):
            for pg in groups:
                remove_placement_group(pg)
            if self.block > 1 and sizes[0] > need:
                return self._new_exact(need, selector, strategy)
            raise errors.CapacityExceeded(
                f"the fleet has no {need} free {SLOT} matching {selector} (Ray placed {sum(ok)} of "
                f"{len(groups)} placement groups within {self.place_timeout:g} s)", status=429,
                code="capacity_exceeded")
        out: List[Slot] = []
        for pg, n in zip(groups, sizes):
            table = placement_group_table(pg)["bundles_to_node_id"]
            blk = _Block(pg, [table[i] for i in range(n)])
            self._blocks.append(blk)
            take = list(range(min(n, need - len(out))))
            for i in take:
                blk.free.discard(i)
                out.append(Slot(self, blk, i))
        return out

    def _new_exact(self, need: int, selector: Dict[str, str], strategy: str) -> List[Slot]:
        """A block of exactly `need` when a bigger one did not fit."""
        saved, self.block = self.block, need
        try:
            return self._new(need, selector, strategy)
        finally:
            self.block = saved

    def _free(self, slot: Slot) -> None:
        with self._lock:
            if slot._released:
                return
            slot._released = True
            b = slot._block
            b.free.add(slot._index)
            if len(b.free) == len(b.nodes):
                self._blocks.remove(b)
                remove_placement_group(b.pg)

    def node_died(self, alive: Set[str]) -> None:
        """Blocks with a bundle on a dead node hand out no more slots; they go once their live slots are free."""
        with self._lock:
            for b in self._blocks:
                if any(n not in alive for n in b.nodes):
                    b.tainted = True

    def held(self) -> int:
        """Slots held from Ray, used or not."""
        with self._lock:
            return sum(len(b.nodes) for b in self._blocks)

    def close(self) -> None:
        with self._lock:
            blocks, self._blocks = self._blocks, []
        for b in blocks:
            remove_placement_group(b.pg)

