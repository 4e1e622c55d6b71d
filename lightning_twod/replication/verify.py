"""Replicas that can be shown identical: a digest of every copy of every replicated shard, compared.

After a reduction (or a drain) every copy of a replicated shard must be bit-identical: its weights
``[R, D]`` and every optimizer state (row-wise AdaGrad's accumulator ``[R]``; the Adam family's moments and
step count). ``ReplicaCheck.verify()`` checks it cheaply:

* each rank digests what it holds (``digest``): the fp32 bits read as int32 and summed with
  wrap-around, per row (``[R]``), then over the rows plainly and weighted by row number (``[2]``).
  Integer sums are exact and do not depend on the order of summation, so equal copies give equal
  digests on any device, and a copy that differs in one bit of one element (one ulp) gives another
  plain sum; the weighted sum also tells rows swapped between positions apart (changes that cancel
  within one row's sum, such as two of its elements swapped, go unseen). About one read of
  the shards at memory speed, no copy;
* one ``all_gather`` over the world moves every rank's digests, all tables at once (``[W, 2 E]``
  int64, ``E``: the most digests a rank holds). Every rank then knows every rank's digests and the
  plan (which shards a rank holds follows from its position in its shard group), so each compares
  the copies of every shard (sharded tables: over their replica group; data-parallel tables: over
  the world) and reaches the same verdict with no further collective;
* a mismatch raises ``ReplicaMismatchError`` on every rank, naming the table, the shard's rows and
  columns, weights or state, and the ranks whose copy differs from the others'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_twod.core.shards import Shard
from lightning_twod.distributed import MeshGroups
from lightning_twod.sparse.optimizers import OPTIMIZERS, SparseOptimizerConfig
from lightning_twod.sparse.sharded import ShardedCollection, all_parts

WEIGHTS, STATE = "weights", "row-wise optimizer state"


def state_kind(optimizer: SparseOptimizerConfig, name: str) -> str:
    """What errors call the state ``name`` of ``optimizer``: ``STATE`` for the one accumulator of the
    row-wise optimizers, else the state by name (``"optimizer state momentum2"``)."""
    return STATE if optimizer.name in OPTIMIZERS else f"optimizer state {name}"


class ReplicaMismatchError(RuntimeError):
    """Copies of a replicated shard differ after a reduction; raised on every rank alike."""


@torch.no_grad()
def digest(tensor: Tensor) -> Tensor:
    """``[2]`` int64 digest of an fp32 or fp16 ``[R, D]`` (or ``[R]``) tensor's bits (read as int32, or int16
    for fp16): their int32 sum and their sum weighted by row number (1..R), both with int32 wrap-around; on
    the tensor's device."""
    bits = tensor.detach().reshape(tensor.shape[0], -1)
    bits = bits.view(torch.int16 if bits.element_size() == 2 else torch.int32)
    rows = bits.sum(dim=1, dtype=torch.int32)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int32, device=rows.device)
    return torch.stack([rows.sum(dtype=torch.int32), (rows * weights).sum(dtype=torch.int32)]).long()


@dataclass(frozen=True)
class Copy:
    """One digested tensor: ``kind`` (weights or state) of ``shard`` of the collection at ``path``."""

    path: str
    shard: Shard
    kind: str

    def describe(self) -> str:
        where = f" in '{self.path}'" if self.path else ""
        s = self.shard
        return (f"table '{s.table}'{where}, shard rows [{s.row_start}, {s.row_end}) "
                f"cols [{s.col_start}, {s.col_end}), {self.kind}")


def held(module: ShardedCollection, path: str, position: int) -> list[Copy]:
    """What a rank at ``position`` of its shard group digests, in ``local_digests``' order: per
    kernel (owned shards, then data-parallel ones), each shard's weights, then for each state (in
    ``state_shapes`` order) each shard's."""
    out = []
    for slots, optimizer in ((module.slots[position], module.optimizer),
                             (module.local_slots, module.data_parallel_optimizer)):
        shards = list(dict.fromkeys(slot.shard for slot in slots))  # the kernel's shard order
        out += [Copy(path, shard, WEIGHTS) for shard in shards]
        for name in optimizer.state_shapes(0, 0):
            out += [Copy(path, shard, state_kind(optimizer, name)) for shard in shards]
    return out


def local_digests(collections: Mapping[str, ShardedCollection]) -> list[Tensor]:
    """This rank's ``[2]`` digests, in ``held``'s order."""
    out = []
    for _, part in all_parts(collections):
        for kernel, _ in part.kernel_shards():
            states = kernel.shard_states()
            out += [digest(t) for t in kernel.weights()]
            out += [digest(s[name]) for name in kernel.optimizer.state_shapes(0, 0) for s in states]
    return out


def differing_ranks(by_rank: Mapping[int, tuple[int, ...]]) -> tuple[list[int], list[int]] | None:
    """``(ranks that differ, ranks of the largest set of equal copies)``, or None when all are equal.
    Ties go to the set with the lowest rank."""
    sets: dict[tuple[int, ...], list[int]] = {}
    for rank in sorted(by_rank):
        sets.setdefault(by_rank[rank], []).append(rank)
    if len(sets) == 1:
        return None
    largest = max(sets.values(), key=len)  # the first of the largest: lowest rank
    return sorted(r for ranks in sets.values() if ranks is not largest for r in ranks), largest


class ReplicaCheck:
    """Compares the copies of every replicated shard of ``collections`` (``{path: twin}``, every part
    over its own groups) over the world of ``groups``; ``device``: where the digests travel (the process group's device)."""

    def __init__(self, collections: Mapping[str, ShardedCollection], groups: MeshGroups,
                 device: torch.device) -> None:
        self.collections, self.group, self.device = collections, groups.world, device
        self.layouts = [[copy for path, part in all_parts(collections)
                         for copy in held(part, path, part.groups.dims.shard_rank(rank))]
                        for rank in range(groups.dims.world_size)]
        holders: dict[Copy, int] = {}
        for layout in self.layouts:
            for copy in layout:
                holders[copy] = holders.get(copy, 0) + 1
        self.replicated = any(count > 1 for count in holders.values())
        self.width = max(map(len, self.layouts))

    @torch.no_grad()
    def verify(self) -> None:
        """Raise ``ReplicaMismatchError`` on every rank if any two copies differ; a collective over
        the world (nothing to do, and no collective, where no shard has a second copy)."""
        if not self.replicated:
            return
        mine = torch.zeros(self.width, 2, dtype=torch.int64, device=self.device)
        digests = local_digests(self.collections)
        if digests:
            mine[:len(digests)] = torch.stack(digests).to(self.device)
        everyone = torch.empty(len(self.layouts), self.width, 2, dtype=torch.int64, device=self.device)
        dist.all_gather(list(everyone.unbind()), mine, group=self.group)
        table = everyone.cpu().tolist()
        copies: dict[Copy, dict[int, tuple[int, ...]]] = {}
        for rank, layout in enumerate(self.layouts):
            for index, copy in enumerate(layout):
                copies.setdefault(copy, {})[rank] = tuple(table[rank][index])
        problems = []
        for copy, by_rank in copies.items():
            found = differing_ranks(by_rank)
            if found is not None:
                problems.append(f"  {copy.describe()}: ranks {found[0]} differ from ranks {found[1]}")
        if problems:
            raise ReplicaMismatchError(
                "the copies of replicated shards are not bit-identical after a reduction:\n" + "\n".join(problems)
                + "\nEvery copy must equal the others once a reduction completes; these diverged (a write to "
                "one copy outside the sparse optimizer, a non-deterministic kernel, or faulty memory on the "
                "ranks named). Stop here and resume from the last checkpoint (written only after this check "
                "passed); verify_replicas='off' turns the check off.")
