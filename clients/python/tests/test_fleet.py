"""grove.ray on a real three-node fleet on this machine (see fleet_cluster.py): placement by Ray (free slots, label
selectors, spread), groved's admission authoritative (a 429 goes elsewhere), no node over-committed, a dead node's
sandboxes reported lost, and a snapshot taken on one node forked on another with only the missing objects moved."""

from __future__ import annotations

import time

import httpx
import pytest

try:
    import ray
except ImportError:
    pytest.fail("ray is not installed in this venv: scripts/setup installs it", pytrace=False)

import grove  # noqa: E402
from grove.ray import SLOT, Fleet, spread  # noqa: E402

from fleet_cluster import Cluster  # noqa: E402

SPECS = [{"sandboxes": 5, "labels": {"pool": "a"}},
         {"sandboxes": 4, "labels": {"pool": "b"}},
         {"sandboxes": 4, "labels": {"pool": "b", "zone": "z2"}}]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(SPECS)
    try:
        c.start()
        c.enter()
        yield c
    finally:
        c.leave()
        restart = []
        for n in c.nodes:
            if n.groved is not None and n.groved.poll() is not None:
                try:
                    n.start_groved()  # a killed node's groved comes back and sweeps what its sandboxes left
                except RuntimeError as e:
                    restart.append(str(e))
        left = c.teardown() + restart
        assert not left, "fleet residue:\n" + "\n".join(left)


@pytest.fixture(scope="module")
def fleet(cluster):
    f = Fleet(address=f"{cluster.subnet}.1:6379", api_key=cluster.api_key, place_timeout=5.0)
    yield f
    f.close()


def node_ids(fleet, cluster) -> dict:
    """node name (n1..) -> Ray node id."""
    by_url = {n.url: n.node_id for n in fleet.nodes()}
    return {n.name: by_url[n.url] for n in cluster.nodes}


def free_slots(expect: float = 13, wait: float = 10.0) -> float:
    """Free grove_slots once Ray has caught up with removals (they land asynchronously), or after `wait`."""
    deadline = time.time() + wait
    while True:
        free = ray.available_resources().get(SLOT, 0.0)
        if free == expect or time.time() > deadline:
            return free
        time.sleep(0.1)


def kill_all(sbxs) -> None:
    for s in sbxs:
        s.kill()


def test_nodes_advertise_capacity_and_labels(fleet, cluster):
    nodes = {n.url: n for n in fleet.nodes()}
    assert len(nodes) == 3
    for spec, n in zip(SPECS, cluster.nodes):
        fnode = nodes[n.url]
        assert fnode.slots == n.info()["capacity"]["total"]["sandboxes"] == spec["sandboxes"]
        assert fnode.labels["image.debian12"] == "cached"
        assert fnode.labels["pool"] == spec["labels"]["pool"]
        assert fnode.labels["gpu"] in ("true", "false")
    assert free_slots() == 13


def test_spread_follows_free_slots(fleet, cluster):
    ids = node_ids(fleet, cluster)
    held = fleet.create(count=3, on=ids["n2"])  # n2: 1 of 4 free; n1: 5 of 5; n3: 4 of 4
    assert spread(held) == {ids["n2"]: 3}
    new = fleet.create(count=6)
    try:
        per = spread(new)
        assert sum(per.values()) == 6
        assert per.get(ids["n2"], 0) <= 1, per
        assert per.get(ids["n1"], 0) >= 2 and per.get(ids["n3"], 0) >= 2, per
        for s in new:
            assert s.exec("echo hi").stdout == "hi\n"
    finally:
        kill_all(held + new)
    assert free_slots() == 13


def test_label_selectors_are_honoured(fleet, cluster):
    ids = node_ids(fleet, cluster)
    b = fleet.create(count=5, labels={"pool": "b"})
    z = fleet.create(count=1, labels={"zone": "z2"})
    try:
        assert set(spread(b)) <= {ids["n2"], ids["n3"]}
        assert set(spread(z)) == {ids["n3"]}
        with pytest.raises(grove.CapacityExceeded):
            fleet.create(count=1, labels={"pool": "nowhere"})
        with pytest.raises(grove.CapacityExceeded):
            fleet.create(count=3, labels={"pool": "b"})  # 8 slots in pool b, 6 taken
        assert free_slots(13 - 6) == 13 - 6, "a refused placement holds no slots"
    finally:
        kill_all(b + z)


def test_no_node_is_over_committed(fleet, cluster):
    ids = node_ids(fleet, cluster)
    every = fleet.create(count=13)
    try:
        assert spread(every) == {ids[n.name]: n.capacity for n in cluster.nodes}
        for n in cluster.nodes:
            info = n.info()
            assert info["sandboxes"] <= info["capacity"]["total"]["sandboxes"]
        with pytest.raises(grove.CapacityExceeded):
            fleet.create(count=1)
    finally:
        kill_all(every)
    assert free_slots() == 13


def test_sandboxes_that_expire_give_their_slots_back(fleet, cluster):
    short = fleet.create(count=13, timeout=1)  # every slot, each sandbox ending by its TTL
    time.sleep(2.5)
    fresh = fleet.create(count=2)
    try:
        assert set(fleet.sandboxes()) == {s.id for s in fresh}, "expired sandboxes hold no leases"
        assert not any(s.is_running() for s in short)
    finally:
        kill_all(fresh)
    assert free_slots() == 13


def test_block_leases_take_slots_from_ray_a_block_at_a_time(fleet, cluster):
    assert free_slots() == 13
    blocky = Fleet(address=f"{cluster.subnet}.1:6379", api_key=cluster.api_key, place_timeout=5.0, block=4)
    made = []
    try:
        made += blocky.create(count=3)  # one placement group of 4 bundles
        made += blocky.create(count=1)  # the block's 4th slot: nothing asked of Ray
        assert (blocky._slots.groups_created, blocky._slots.held()) == (1, 4)
        assert free_slots(13 - 4) == 13 - 4
        made += blocky.create(count=6)  # more than a block: one group of 6
        assert (blocky._slots.groups_created, blocky._slots.held()) == (2, 10)
        with pytest.raises(grove.CapacityExceeded):
            blocky.create(count=4)  # 3 left
        for n in cluster.nodes:
            info = n.info()
            assert info["sandboxes"] <= info["capacity"]["total"]["sandboxes"]
        for s in made:
            assert s.exec("echo hi").stdout == "hi\n"
    finally:
        kill_all(made)
        assert blocky._slots.held() == 0, "blocks go back to Ray once all their slots are free"
        blocky.close()
    assert free_slots() == 13


def test_a_node_that_refuses_sends_placements_elsewhere(fleet, cluster):
    ids = node_ids(fleet, cluster)
    n1 = cluster.nodes[0]
    with n1.http() as h:  # n1 fills up behind Ray's back: Ray still sees 5 free slots there
        r = h.post("/v1/sandboxes", json={"image": "debian12", "count": 5})
        assert r.status_code == 201, r.text
        direct = [x["sandbox"]["id"] for x in r.json()["results"]]
    try:
        made = fleet.create(count=8)
        try:
            assert ids["n1"] not in spread(made)
            assert sum(spread(made).values()) == 8
            assert (ids["n1"], "capacity_exceeded") in fleet.last_placement.refusals
        finally:
            kill_all(made)
    finally:
        with n1.http() as h:
            for sid in direct:
                h.delete(f"/v1/sandboxes/{sid}")


def test_snapshot_forks_on_another_node_moving_only_missing_objects(fleet, cluster):
    ids = node_ids(fleet, cluster)
    [src] = fleet.create(on=ids["n1"])
    branches = []
    try:
        src.exec("head -c 3000000 /dev/urandom > /root/blob && echo fleet > /root/mark")
        snap = src.snapshot(name=f"fleet-{src.id[:8]}")
        full = len(fleet.client(ids["n1"]).request("GET", f"/v1/snapshots/{snap.name}/export").content)
        branches = fleet.fork(snap, 2, on=ids["n2"])
        assert spread(branches) == {ids["n2"]: 2}
        [t] = fleet.transfers
        assert 0 < t.objects_sent < t.objects
        assert t.bytes_sent < full / 2, (t.bytes_sent, full)
        print(f"\nFLEET-TRANSFER snapshot {snap.name}: {t.objects_sent} of {t.objects} objects, "
              f"{t.bytes_sent} bytes pulled n1->n2 by n2 (a self-contained export is {full} bytes, "
              f"{100 * t.bytes_sent / full:.1f} %)")
        for b in branches:
            assert b.exec("cat /root/mark").stdout == "fleet\n"
        more = fleet.fork(snap, 1, on=ids["n2"])
        branches += more
        assert len(fleet.transfers) == 1, "the target already holds the snapshot"
    finally:
        kill_all(branches + [src])
        for n in ("n1", "n2"):
            try:
                fleet.client(ids[n]).request("DELETE", f"/v1/snapshots/{snap.name}")
            except (grove.NotFound, NameError):
                pass


def test_a_dead_node_loses_its_sandboxes_and_creates_go_elsewhere(fleet, cluster):
    ids = node_ids(fleet, cluster)
    assert free_slots() == 13
    made = fleet.create(count=2, on=ids["n2"]) + fleet.create(count=4)
    on_n2 = {s.id for s in made if s.node_id == ids["n2"]}
    n2 = cluster.nodes[1]
    n2.kill()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{n2.url}/v1/health", timeout=1)
    deadline = time.time() + 30
    lost: list = []
    while time.time() < deadline and set(lost) != on_n2:
        lost += fleet.lost()
        time.sleep(0.2)
    assert set(lost) == on_n2
    assert ids["n2"] not in {n.node_id for n in fleet.nodes()}
    fresh = fleet.create(count=4)
    try:
        assert ids["n2"] not in spread(fresh)
    finally:
        kill_all(fresh + [s for s in made if s.id not in on_n2])
