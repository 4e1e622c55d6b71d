"""The cross-group reduction of a model (``sync_mode="weights"``): rounds, blocking or overlapped.

Copies of a shard are identical right after a reduction, so only the rows some copy touched since
then can differ. A round first agrees on those rows (one all-reduce of the copies' row masks,
packed eight rows a byte, bitwise OR), then moves just them, weights and every optimizer state
(``SparseOptimizerConfig.state_shapes``), in one coalesced buffer per process group (``rounds``;
``quantized`` for the int8 wire): the replica group for sharded tables, the world for data-parallel
ones. Every collection of the model shares those buffers. On a bf16 or int8 wire the states that must
stay exact (``SparseOptimizerConfig.exact_states``: the Adam family's second moment and step count)
go in an fp32 round of their own over the same group, with its own agreement on the rows (one more
all-reduce of the row masks).

``reduce()`` runs a round and waits for it. ``launch()`` applies the round in flight, if any, then
starts one and returns; ``finish()`` waits for the round in flight and applies it. With
``sync_overlap`` the strategy launches a round whenever one is due, so each round's transfer has the
``sync_interval`` steps until the next one to hide under the training.

Non-finite values (NaN or inf) are never averaged in: a round applies nothing until it knows that
every copy sent finite values, and otherwise raises ``NonFiniteError`` on every rank, naming the
tables and the ranks, with every copy as it was before the round. What it costs: within a group the
verdict rides the round's own all-reduce (the sum of the copies' values or changes is non-finite
exactly where one copy's is; the int8 wire marks such rows in its exponents), read with one pass
over the summed buffer (``sparse.kernels.nonfinite_mark``: 2 ms for 4 Mi fp32 elements on one CPU core,
where their all-reduce between two gloo processes takes 27 ms); a round's result is then applied
once all of it arrived, not piece by piece while the last pieces are on the wire. Across groups
(``across``: the mesh's shard group, which holds one member of every replica group, or the world
where tables have their own group sizes and so their own replica groups) one all-reduce
of one number per round makes every rank of the world take the same decision: its latency, 1.1 ms
between four gloo processes sharing two CPU cores.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_twod.core.reduction import sent_whole
from lightning_twod.core.shards import Shard
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.distributed.consensus import agree_min
from lightning_twod.distributed.groups import group_size, has_process_group
from lightning_twod.replication import wire
from lightning_twod.replication.quantized import QuantizedRound, add_residuals, levels, nonfinite_sums, sum_residuals
from lightning_twod.replication.rounds import BlockingRound, OverlappedRound, Segment, Workspace
from lightning_twod.replication.touched import TouchedRows
from lightning_twod.sparse.kernels import LookupKernel


@dataclass
class ReplicatedKernel:
    """A kernel whose shards have a copy on every member of ``group`` (global ranks ``peers``);
    ``shards``: what its shards are, in kernel order, for the errors (None: "shard k")."""

    kernel: LookupKernel
    group: ProcessGroup | None
    peers: list[int]
    shards: Sequence[Shard] | None = None

    def name(self, k: int) -> str:
        """What errors call shard ``k`` of the kernel."""
        if self.shards is None:
            return f"shard {k}"
        s = self.shards[k]
        return f"table '{s.table}', shard rows [{s.row_start}, {s.row_end}) cols [{s.col_start}, {s.col_end})"


class NonFiniteError(FloatingPointError):
    """A replica round or gradient average met NaN or inf on some copy; raised on every rank alike,
    before anything was averaged in."""


def agree_finite(finite: bool, across: ProcessGroup | None) -> bool:
    """Whether ``finite`` holds on every rank of ``across`` (one all-reduce of one number; None or a
    group of one: no collective)."""
    if group_size(across) == 1:
        return finite
    return agree_min([float(finite)], across)[0] == 1.0


def raise_nonfinite(what: str, local: Sequence[str],
                    outcome: str = "Nothing was averaged in: every copy keeps what it held before.") -> NoReturn:
    """Raise ``NonFiniteError`` on every rank: ``what`` held NaN or inf in ``local`` (the shards this
    rank found them in); ``outcome``: what became of the rows. A collective over the world, one
    all-gather of the ranks' findings, so that every rank raises the same message; every rank must
    call it."""
    world = dist.get_world_size() if has_process_group() else 1
    found: list[list[str]] = [list(local)]
    if world > 1:
        found = [[] for _ in range(world)]
        dist.all_gather_object(found, list(local))
    ranks: dict[str, list[int]] = {}
    for rank, names in enumerate(found):
        for name in names:
            ranks.setdefault(name, []).append(rank)
    where = "; ".join(f"{name} on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}" for name, r in ranks.items())
    raise NonFiniteError(
        f"non-finite values (NaN or inf) in the {what}: {where or 'each copy finite, their sum overflows'}. "
        f"{outcome} They came from this copy's "
        "own steps (a learning rate too large, NaN or inf in a batch, the loss or a row written by hand); "
        "fix the cause and resume from the last checkpoint"
    )


def check_single_copies(single: Sequence[ReplicatedKernel], step: int, world: ProcessGroup | None) -> None:
    """Raise ``NonFiniteError`` on every rank if a gradient of this step (``step``) held NaN or inf where it
    reached a shard with a single copy (no round checks those rows), naming its table; a collective over
    ``world`` (one all-reduce of one number) that every rank calls, also one holding no such shard.
    Reads the marks the kernels keep of what their update reads (``LookupKernel.gradient_marks``)."""
    marks = [replicated.kernel.gradient_marks() for replicated in single]
    finite = not marks or bool(torch.isfinite(torch.cat(marks).sum()))
    if agree_finite(finite, world):
        return
    local = [replicated.name(k) for replicated, mark in zip(single, marks, strict=True)
             for k in torch.nonzero(~torch.isfinite(mark)).flatten().tolist()]
    raise_nonfinite(f"gradients of step {step} for shards that have a single copy", local,
                    "Rows of torch kernels were not updated; FBGEMM kernels had applied them in backward.")


def count_all_reduce(counter: ByteCounter | None, name: str, peers: Sequence[int], nbytes: int) -> None:
    """Record a ring all-reduce: it sends ``2 (M - 1) / M`` of the buffer, evenly over the ``M - 1`` peers."""
    if counter is not None and len(peers) > 1:
        counter.add(name, peers, [2 * nbytes // len(peers)] * len(peers))


def pack_bits(mask: Tensor) -> Tensor:
    """``[n]`` bool -> ``[ceil(n / 8)]`` uint8, row ``i`` in bit ``i % 8`` of byte ``i // 8``."""
    padded = torch.zeros(-(-mask.numel() // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:mask.numel()] = mask
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """The inverse of ``pack_bits``: ``[n]`` bool."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:n].bool()


@dataclass
class Proposal:
    """A group's row masks ``[rows of each kernel's shards]`` taken for a round, packed ``[ceil(n / 8)]``
    uint8, and the all-reduce that ORs the packed masks over the copies (``work``)."""

    masks: list[Tensor]
    packed: Tensor
    work: object


class _Group:
    """The replicated kernels that share one process group, with their row masks, references and
    (int8 wire) residuals."""

    def __init__(self, members: list[ReplicatedKernel], sync_dtype: str, part: str = "all") -> None:
        self.members, self.group, self.peers = members, members[0].group, members[0].peers
        self.part = part  # which of each shard's tensors this group's rounds send (``_shard_tensors``)
        self.copies = group_size(self.group)
        self.quantized = wire.quantized(sync_dtype)
        if self.quantized:
            levels(self.copies)  # refuses more copies than an int8 sum holds
        self.touched = [TouchedRows(m.kernel) for m in members]
        self.sync_dtype = sync_dtype
        self.workspace = Workspace(members[0].kernel.device())
        self.references: list[list[tuple[Tensor, ...]]] = []
        self.residuals: list[list[tuple[Tensor, ...]]] = []
        self.reset_references()

    @torch.no_grad()
    def reset_references(self) -> None:
        """Take the copies' current rows as the reference (they must be identical on every copy),
        and start the residuals afresh.

        A kernel's references lie end to end in one buffer per kind (weights, state) as its live
        tensors do, so that whole shards reduce as one span.
        """
        self.references = []
        self.residuals = [[tuple(torch.zeros_like(t) for t in shard) for shard in self.shard_tensors(m)]
                          for m in self.members] if self.quantized else []
        if not wire.needs_reference(self.sync_dtype):
            return
        for member in self.members:
            shards = self.shard_tensors(member)
            copies = []
            for column in zip(*shards, strict=True):
                flat = torch.cat([t.reshape(-1) for t in column])
                copies.append([block.view_as(t) for block, t in zip(flat.split([t.numel() for t in column]), column)])
            self.references.append(list(zip(*copies, strict=True)))

    def shard_tensors(self, member: ReplicatedKernel) -> list[tuple[Tensor, ...]]:
        """Per shard of ``member``, the tensors this group's rounds send."""
        return _shard_tensors(member.kernel, self.part)

    def propose(self, settle: bool) -> Proposal:
        """Take the row masks since the last round and start agreeing on them (an all-reduce, bitwise OR,
        in flight until ``segments`` reads it); ``settle`` (a round that waits): with the rows an
        overlapped bf16 round left different (``TouchedRows.owe``)."""
        masks = [touched.take(settle) for touched in self.touched]
        packed = pack_bits(torch.cat(masks))
        return Proposal(masks, packed, dist.all_reduce(packed, op=dist.ReduceOp.BOR, group=self.group, async_op=True))

    def withdraw(self, proposal: Proposal) -> None:
        """Give the masks of a round that will not run back to the row masks, for the next round."""
        proposal.work.wait()
        for touched, mask in zip(self.touched, proposal.masks, strict=True):
            touched.mask |= mask

    def segments(self, proposal: Proposal, counter: ByteCounter | None, name: str) -> list[Segment]:
        """The rows touched on any copy (once the proposal's all-reduce is in), and what to send."""
        packed = proposal.packed
        proposal.work.wait()
        count_all_reduce(counter, name, self.peers, packed.numel())
        union = unpack_bits(packed, sum(m.numel() for m in proposal.masks))
        shard_rows = [rows for touched in self.touched for rows in touched.shard_rows]
        per_shard = torch.split(union, shard_rows)
        counts = torch.stack([m.sum() for m in per_shard]).tolist()  # one host sync for all shards
        segments, shard = [], 0
        for index, (member, touched) in enumerate(zip(self.members, self.touched, strict=True)):
            for k, tensors in enumerate(self.shard_tensors(member)):
                rows, count, mine = touched.shard_rows[k], counts[shard], per_shard[shard]
                if count:
                    whole = sent_whole(count, rows)
                    picked = None if whole else mine.nonzero().squeeze(1)
                    references = list(self.references[index][k]) if self.references else None
                    residuals = list(self.residuals[index][k]) if self.residuals else None
                    union = mine if whole and self.quantized else None  # int8: the others send nothing
                    segments.append(Segment(list(tensors), references, picked, residuals, union, member.name(k),
                                            functools.partial(touched.owe, k)))
                shard += 1
        return segments


def _shard_tensors(kernel: LookupKernel, part: str = "all") -> list[tuple[Tensor, ...]]:
    """Per shard, its ``[R, d]`` tensors: weights ``[R, D]``, then each optimizer state in ``state_shapes``
    order (``[R, D]``, or a ``[R]`` one as ``[R, 1]``). ``part``: ``"all"``; ``"wire"``: the weights and the
    states a bf16 or int8 wire carries; ``"exact"``: the ``exact_states``, sent in fp32; ``"rows"``: the
    weights alone. fp16 weights are in ``"rows"`` only (``wire.rows_dtype``)."""
    exact = kernel.optimizer.exact_states
    out = []
    for weight, states in zip(kernel.weights(), kernel.shard_states(), strict=True):
        tensors = [weight] if part == "rows" or (part != "exact" and weight.dtype == torch.float32) else []
        tensors += [state if state.dim() == 2 else state.unsqueeze(1) for name, state in states.items()
                    if part == "all" or (part != "rows" and (name in exact) == (part == "exact"))]
        out.append(tuple(tensors))
    return out


def _split_groups(members: list[ReplicatedKernel], sync_dtype: str) -> list[_Group]:
    """The groups of one process group's kernels: one on ``sync_dtype``; on a bf16 or int8 wire where
    some kernels have ``exact_states`` (tables may have optimizers of their own), one for every kernel's
    weights and other states on that wire and one for those kernels' exact states in fp32. The fp16 rows
    of kernels that keep them go in a group of their own, as they are (``wire.rows_dtype``), and their
    states with the other kernels'."""
    half = [member for member in members if member.kernel.weights()[0].dtype != torch.float32]
    rows = [_Group(half, "fp32", "rows")] if half else []
    members = [member for member in members if member not in half or member.kernel.optimizer.has_state]
    if not members:
        return rows
    exact = [member for member in members if member.kernel.optimizer.exact_states]
    if not wire.needs_reference(sync_dtype) or not exact:
        return [_Group(members, sync_dtype), *rows]
    return [_Group(members, sync_dtype, "wire"), _Group(exact, "fp32", "exact"), *rows]


class ReplicaReducer:
    """Keeps the copies of every replicated shard of a model consistent (``sync_mode="weights"``).

    ``sync_dtype``: ``"fp32"``, ``"bf16"`` or ``"int8"`` payload (``replication.wire``). Kernels
    whose group has one member take no part. ``across``: the group that joins the kernels' groups
    into the world (the mesh's shard group; the world where tables have their own group sizes), over
    which every round's verdict on non-finite values is
    agreed; None when the groups span the world. Every rank of the world runs the rounds together,
    also a rank that holds no replicated shard.
    """

    def __init__(self, replicated: Sequence[ReplicatedKernel], sync_dtype: str = "fp32",
                 counter: ByteCounter | None = None, name: str = "replica_sync",
                 across: ProcessGroup | None = None) -> None:
        if sync_dtype not in wire.WIRE_DTYPES:
            raise ValueError(f"sync_dtype={sync_dtype!r}; use one of {tuple(wire.WIRE_DTYPES)}")
        by_group: dict[int, list[ReplicatedKernel]] = {}
        for member in replicated:
            if group_size(member.group) > 1:
                by_group.setdefault(id(member.group), []).append(member)
        self.groups = [group for members in by_group.values() for group in _split_groups(members, sync_dtype)]
        self.counter, self.name, self.across, self.sync_dtype = counter, name, across, sync_dtype
        self.in_flight: list[OverlappedRound | QuantizedRound] = []
        self.launched = False  # a round is in flight on every rank (a rank without groups has no rounds)
        # an int8 round was applied since the last flush, on every rank alike: a flush is due
        self.residuals_owed = False
        # an overlapped bf16 round was applied since the last round that waited, on every rank alike:
        # the copies differ by its residuals until a round that waits sends them (a drain runs one)
        self.unsettled = False
        self.last_rows = 0
        # time the caller spent in rounds: launching and applying overlapped ones, and blocking ones
        self.seconds = {"launch": 0.0, "wait_and_apply": 0.0, "blocking": 0.0}
        # the same time by part, whatever the kind of round: agreeing on the touched rows (one
        # all-reduce), packing the wire buffer (int8: with the exponents' all-reduce), waiting for
        # the sums, applying them
        self.parts = {"agree_rows": 0.0, "pack": 0.0, "wait": 0.0, "apply": 0.0}
        self.bytes_sent = 0

    def memory(self) -> dict[str, int]:
        """What the rounds hold besides the tables: ``bytes`` (the references, residuals and the buffers
        kept from round to round) and ``elements`` (of the replicated shards, weights and state)."""
        held = elements = 0
        for group in self.groups:
            for member in group.members:
                elements += sum(t.numel() for shard in group.shard_tensors(member) for t in shard)
            kept = [t for shards in (*group.references, *group.residuals) for shard in shards for t in shard]
            held += sum(t.numel() * t.element_size() for t in kept)
            held += sum(b.numel() * b.element_size() for b in group.workspace.buffers.values())
        return {"bytes": held, "elements": elements}

    def reset_references(self) -> None:
        """After the copies were overwritten together (a checkpoint was loaded): new references."""
        for group in self.groups:
            group.reset_references()
        self.residuals_owed = self.unsettled = False

    @torch.no_grad()
    def discard(self) -> None:
        """Drop the rounds in flight, unapplied, and forget the rows touched since the last round: the
        copies were (or are about to be) overwritten together. Waits for the rounds' transfers, which
        every copy started; no collective of its own."""
        for flight in self.in_flight:
            flight.wire.wait(flight.buffer.numel())
        self.in_flight, self.launched = [], False
        for group in self.groups:
            for touched in group.touched:
                touched.take(settle=True)

    def _propose(self, settle: bool) -> list[Proposal]:
        start = time.perf_counter()
        proposals = [group.propose(settle) for group in self.groups]
        self.parts["agree_rows"] += time.perf_counter() - start
        return proposals

    def _start(self, proposals: list[Proposal], overlapped: bool) -> list:
        rounds = []
        for group, proposal in zip(self.groups, proposals, strict=True):
            start = time.perf_counter()
            segments = group.segments(proposal, self.counter, self.name)
            self.parts["agree_rows"] += time.perf_counter() - start
            start = time.perf_counter()
            if group.quantized:
                flight = QuantizedRound(segments, group.group, group.copies, group.workspace, overlapped)
            else:
                kind = OverlappedRound if overlapped else BlockingRound
                flight = kind(segments, group.group, group.copies, group.sync_dtype, group.workspace)
            self.parts["pack"] += time.perf_counter() - start
            count_all_reduce(self.counter, self.name, group.peers, flight.nbytes)
            self.bytes_sent += flight.nbytes
            rounds.append(flight)
        self.last_rows = sum(flight.rows for flight in rounds)
        return rounds

    @torch.no_grad()
    def launch(self) -> int:
        """Start a round over every group (after applying one still in flight); returns the rows sent.
        The copies agree on the rows while the round in flight is applied."""
        proposals = self._propose(settle=False)
        try:
            self.finish()
        except BaseException:
            for group, proposal in zip(self.groups, proposals, strict=True):
                group.withdraw(proposal)
            raise
        start = time.perf_counter()
        self.in_flight, self.launched = self._start(proposals, overlapped=True), True
        self.seconds["launch"] += time.perf_counter() - start
        return self.last_rows

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the rounds in flight and apply them (``NonFiniteError``: see ``_apply``)."""
        if not self.launched:
            return
        start = time.perf_counter()
        rounds, self.in_flight, self.launched = self.in_flight, [], False
        self._apply(rounds)
        self.unsettled = self.sync_dtype == "bf16"
        self.seconds["wait_and_apply"] += time.perf_counter() - start

    @torch.no_grad()
    def reduce(self) -> int:
        """A round, waited for: every copy of every touched row is identical afterwards."""
        self.finish()
        start = time.perf_counter()
        self._apply(self._start(self._propose(settle=True), overlapped=False))
        self.unsettled = False
        self.seconds["blocking"] += time.perf_counter() - start
        return self.last_rows

    def _apply(self, rounds: list) -> None:
        """Wait for ``rounds`` and apply them if every copy in the world sent finite values; else raise
        ``NonFiniteError`` on every rank, with nothing applied (cost: the module docstring)."""
        start = time.perf_counter()
        finite = all([flight.finite() for flight in rounds])  # a list: every round is waited for
        self.parts["wait"] += time.perf_counter() - start
        if not agree_finite(finite, self.across):
            raise_nonfinite("rows a replica round was about to average",
                            [seg.name for flight in rounds for seg in flight.nonfinite_segments()])
        start = time.perf_counter()
        for flight in rounds:
            flight.finish()
        self.parts["apply"] += time.perf_counter() - start
        self.residuals_owed = wire.quantized(self.sync_dtype)

    @torch.no_grad()
    def flush_residuals(self) -> None:
        """The end of a drain (identical copies): on the int8 wire, every copy's residual goes into the
        weights (``quantized.sum_residuals``, ``add_residuals``), so that no later result depends on a
        residual. A residual that sums to NaN or inf (left by a round that stopped on one) raises
        ``NonFiniteError`` on every rank with nothing added."""
        self.finish()
        if not self.residuals_owed:  # nothing applied since the last flush: every residual is zero
            return
        flushes, spoiled = [], []
        for group in self.groups:
            if not group.quantized:
                continue
            names = [member.name(k) for member in group.members for k in range(len(group.shard_tensors(member)))]
            shards = [(list(live), list(references), list(residuals)) for member, kept, owed in
                      zip(group.members, group.references, group.residuals, strict=True)
                      for live, references, residuals in zip(group.shard_tensors(member), kept, owed, strict=True)]
            summed, nbytes = sum_residuals(shards, group.group)
            count_all_reduce(self.counter, self.name, group.peers, nbytes)
            self.bytes_sent += nbytes
            spoiled += [names[index] for index in nonfinite_sums(shards, summed)]
            flushes.append((shards, summed, group.copies))
        # every rank agrees, also one holding no replicated shard (no groups, nothing to flush)
        if wire.quantized(self.sync_dtype) and not agree_finite(not spoiled, self.across):
            raise_nonfinite("int8 residuals a drain was about to add", spoiled)
        for shards, summed, copies in flushes:
            add_residuals(shards, summed, copies)
        self.residuals_owed = False
