"""Tests of ``core.mesh`` and ``distributed.groups`` without process groups: the grid arithmetic (the
real groups on 4 processes: ``tests/system/test_topology.py``)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from lightning_twod.distributed import MeshGroups, SparseParallelDims, build_mesh

# ----------------------------------------------------------------------------- exact layouts


def test_contiguous_w8_s4():
    d = SparseParallelDims(world_size=8, shard_group_size=4)
    assert d.placement == "contiguous"
    assert d.num_replicas == 2
    assert d.mesh_layout().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.mesh_layout().dtype == torch.int64
    assert d.shard_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.shard_group(6) == [4, 5, 6, 7]
    assert d.replica_group(6) == [2, 6]
    assert d.coords(6) == (1, 2)
    assert d.shard_rank(6) == 2
    assert d.replica_rank(6) == 1


def test_contiguous_w8_s2():
    d = SparseParallelDims(world_size=8, shard_group_size=2)
    assert d.num_replicas == 4
    assert d.mesh_layout().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.shard_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.coords(5) == (2, 1)


def test_strided_w8_s4():
    d = SparseParallelDims(world_size=8, shard_group_size=4, placement="strided")
    assert d.num_replicas == 2
    layout = d.mesh_layout()
    assert layout.dtype == torch.int64 and layout.is_contiguous()
    assert layout.tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.shard_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert d.replica_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.shard_group(5) == [1, 3, 5, 7]
    assert d.replica_group(5) == [4, 5]
    assert d.coords(5) == (1, 2)
    assert d.shard_rank(5) == 2


def test_strided_w8_s2():
    d = SparseParallelDims(world_size=8, shard_group_size=2, placement="strided")
    assert d.num_replicas == 4
    assert d.mesh_layout().tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.shard_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.replica_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.coords(6) == (2, 1)


def test_trivial_1x1():
    d = SparseParallelDims(1, 1)
    assert d.is_trivial and d.is_1d
    assert d.num_replicas == 1
    assert d.mesh_layout().tolist() == [[0]]
    assert d.shard_groups() == [[0]] and d.replica_groups() == [[0]]
    assert d.coords(0) == (0, 0)
    g = MeshGroups.single_process()
    assert g.dims == d and g.rank == 0
    assert g.world is None and g.shard is None and g.replica is None and g.mesh is None
    assert (g.shard_rank, g.replica_rank, g.shard_ranks, g.replica_ranks) == (0, 0, [0], [0])


def test_create_without_process_group_single_rank():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # pragma: no cover
        pytest.skip("a default process group exists in this process")
    g = MeshGroups.create(SparseParallelDims(1, 1, placement="strided"))
    assert g.dims.placement == "strided"
    assert g.world is None and g.shard is None and g.replica is None and g.mesh is None


def test_1d_and_pure_replication():
    one_d = SparseParallelDims(4, 4)
    assert one_d.is_1d and not one_d.is_trivial
    assert one_d.shard_groups() == [[0, 1, 2, 3]]
    assert one_d.replica_groups() == [[0], [1], [2], [3]]
    rep = SparseParallelDims(4, 1, placement="strided")
    assert not rep.is_1d
    assert rep.shard_groups() == [[0], [1], [2], [3]]
    assert rep.replica_groups() == [[0, 1, 2, 3]]


# ----------------------------------------------------------------------------- consistency

COMBOS = [
    (w, s, p)
    for w in (1, 2, 3, 4, 6, 8, 12, 16)
    for s in range(1, w + 1)
    if w % s == 0
    for p in ("contiguous", "strided")
]


@pytest.mark.parametrize(("world_size", "shard_group_size", "placement"), COMBOS)
def test_groups_consistent_with_layout(world_size, shard_group_size, placement):
    d = SparseParallelDims(world_size, shard_group_size, placement)
    layout = d.mesh_layout()
    m, s = d.num_replicas, d.shard_group_size
    assert layout.shape == (m, s) and m * s == world_size
    assert sorted(layout.flatten().tolist()) == list(range(world_size))
    assert d.shard_groups() == layout.tolist()
    assert d.replica_groups() == layout.t().tolist()
    for rank in range(world_size):
        i, j = d.coords(rank)
        assert layout[i, j].item() == rank
        assert d.shard_rank(rank) == j and d.replica_rank(rank) == i
        assert d.shard_group(rank) == layout[i].tolist()
        assert d.replica_group(rank) == layout[:, j].tolist()
        assert d.shard_group(rank)[j] == rank and d.replica_group(rank)[i] == rank
    # shard groups partition the ranks, and so do the replica groups
    assert sorted(r for g in d.shard_groups() for r in g) == list(range(world_size))
    assert sorted(r for g in d.replica_groups() for r in g) == list(range(world_size))


@pytest.mark.parametrize("placement", ["contiguous", "strided"])
def test_rank_out_of_range(placement):
    d = SparseParallelDims(8, 4, placement)
    for bad in (-1, 8, 100):
        for fn in (d.coords, d.shard_group, d.replica_group, d.shard_rank):
            with pytest.raises(ValueError, match=rf"rank={bad}.*\[0, 8\)"):
                fn(bad)
    with pytest.raises(ValueError, match="rank"):
        d.coords(True)
    with pytest.raises(ValueError, match="rank"):
        MeshGroups(dims=d, rank=8, world=None, shard=None, replica=None, mesh=None)


# ----------------------------------------------------------------------------- validation


def test_shard_group_size_must_divide():
    with pytest.raises(ValueError) as e:
        SparseParallelDims(8, 3)
    msg = str(e.value)
    assert "shard_group_size=3" in msg and "world_size=8" in msg
    assert "choose one of 1, 2, 4, 8" in msg
    with pytest.raises(ValueError, match="shard_group_size=16 does not divide world_size=8"):
        SparseParallelDims(8, 16)
    with pytest.raises(ValueError, match="choose one of 1, 2, 3, 4, 6, 12"):
        SparseParallelDims(12, 5)


def test_world_size_invalid():
    for bad in (0, -4):
        with pytest.raises(ValueError, match=rf"world_size={bad} must be >= 1"):
            SparseParallelDims(bad, 1)
    for bad in (True, 8.0, "8", None):
        with pytest.raises(ValueError, match="world_size must be an int"):
            SparseParallelDims(bad, 1)


def test_shard_group_size_invalid():
    for bad in (0, -2):
        with pytest.raises(ValueError) as e:
            SparseParallelDims(8, bad)
        assert f"shard_group_size={bad} must be >= 1" in str(e.value)
        assert "1, 2, 4, 8" in str(e.value)
    for bad in (True, False, 4.0, "4", None):
        with pytest.raises(ValueError, match="shard_group_size must be an int.*1, 2, 4, 8"):
            SparseParallelDims(8, bad)


def test_placement_invalid():
    with pytest.raises(ValueError) as e:
        SparseParallelDims(8, 4, placement="row_major")
    msg = str(e.value)
    assert "'row_major'" in msg and "'contiguous'" in msg and "'strided'" in msg


def test_ranks_per_node_invalid():
    with pytest.raises(ValueError) as e:
        SparseParallelDims(8, 4, ranks_per_node=3)
    assert "ranks_per_node=3 does not divide world_size=8" in str(e.value)
    assert "1, 2, 4, 8" in str(e.value)
    with pytest.raises(ValueError, match="ranks_per_node=16 does not divide world_size=8"):
        SparseParallelDims(8, 4, ranks_per_node=16)
    with pytest.raises(ValueError, match="ranks_per_node=0 must be >= 1"):
        SparseParallelDims(8, 4, ranks_per_node=0)
    with pytest.raises(ValueError, match="ranks_per_node must be an int or None"):
        SparseParallelDims(8, 4, ranks_per_node=True)


def test_frozen_hashable_picklable():
    d = SparseParallelDims(8, 4, "strided", ranks_per_node=4)
    with pytest.raises(AttributeError):
        d.world_size = 4  # type: ignore[misc]
    assert d == SparseParallelDims(8, 4, "strided", 4)
    assert hash(d) == hash(SparseParallelDims(8, 4, "strided", 4))
    assert d != SparseParallelDims(8, 4, "contiguous", 4)
    assert pickle.loads(pickle.dumps(d)) == d
    assert copy.deepcopy(d) == d
    assert [f.name for f in dataclasses.fields(d)] == ["world_size", "shard_group_size", "placement", "ranks_per_node"]


# ----------------------------------------------------------------------------- locality / describe


def test_locality_contiguous_node_sized_shard_groups():
    d = SparseParallelDims(8, 4, ranks_per_node=4)
    assert [d.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    loc = d.locality()
    assert loc["num_nodes"] == 2 and loc["ranks_per_node"] == 4
    assert loc["shard_groups_intra_node"] is True
    assert loc["replica_groups_intra_node"] is False
    assert loc["shard_group_max_nodes"] == 1 and loc["replica_group_max_nodes"] == 2


def test_locality_strided_node_sized_replica_groups():
    d = SparseParallelDims(8, 2, placement="strided", ranks_per_node=4)  # M = 4 = ranks_per_node
    loc = d.locality()
    assert loc["replica_groups_intra_node"] is True
    assert loc["shard_groups_intra_node"] is False
    assert loc["shard_group_max_nodes"] == 2


def test_locality_single_node_and_unknown():
    assert SparseParallelDims(8, 2, "strided", ranks_per_node=8).locality()[
        "shard_groups_intra_node"
    ]
    d = SparseParallelDims(8, 4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        d.node_of(0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        d.locality()


@pytest.mark.parametrize("placement", ["contiguous", "strided"])
@pytest.mark.parametrize("ranks_per_node", [None, 4])
def test_describe_mentions_every_rank(placement, ranks_per_node):
    d = SparseParallelDims(16, 4, placement, ranks_per_node=ranks_per_node)
    text = d.describe()
    lines = text.splitlines()
    assert "world_size=16" in lines[0] and placement in lines[0]
    shard_lines = [line for line in lines if "(row " in line]
    replica_lines = [line for line in lines if "(column " in line]
    assert len(shard_lines) == 4 and len(replica_lines) == 4
    for group, line in zip(d.shard_groups(), shard_lines):
        assert str(group) in line
    for group, line in zip(d.replica_groups(), replica_lines):
        assert str(group) in line
    tokens = text.replace("[", " ").replace("]", " ").replace(",", " ").split()
    numbers = {int(tok) for tok in tokens if tok.isdigit()}
    assert set(range(16)) <= numbers
    if ranks_per_node is not None:
        assert "node" in shard_lines[0] and "intra-node" in lines[-1]


def test_build_mesh_requires_process_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # pragma: no cover
        pytest.skip("a default process group exists in this process")
    with pytest.raises(RuntimeError, match=r"world_size=8.*init_process_group"):
        build_mesh(SparseParallelDims(8, 4))
    with pytest.raises(RuntimeError, match="world_size=4"):
        MeshGroups.create(SparseParallelDims(4, 2))


# ----------------------------------------------------------------------------- 4 processes, gloo


