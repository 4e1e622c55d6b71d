"""The training arithmetic of ``TwoDSparseStrategy`` on ``W`` ranks, computed in one process.

Quality studies need many runs (layouts x optimizers x learning rates x seeds). The quality of a
run depends only on its arithmetic, which this emulator reproduces for table-wise/row-wise and
data-parallel tables without processes or collectives (tests check it against real multi-process
runs):

* rank ``r`` of ``W`` gets its slice of the global batch; rank ``r`` belongs to replica group
  ``r // S`` (contiguous placement: which ranks share a group decides which samples are pooled);
  a table with its own group size ``S_t`` (``group_sizes``) has ``W / S_t`` copies, rank ``r``
  using copy ``r // S_t``;
* dense parameters: one copy, stepped by the user's optimizer on the mean of the ``W`` ranks'
  gradients (what DDP computes);
* every replica group ``i`` has its own copy of the sharded tables and optimizer state (every state of
  ``SparseOptimizerConfig.state_shapes``, by name); its gradient
  is the mean over its ``S`` ranks (the ``1 / S`` output-dist scaling); every rank has its own copy
  of a data-parallel table, stepped with its own local-batch gradient;
* ``sync_mode="weights"``: each copy takes its own sparse step, and every ``sync_interval`` steps
  the copies are averaged (sharded tables over the ``M`` replica groups, data-parallel tables over
  the ``W`` ranks; averaging whole tables equals the touched-rows reduction, untouched rows being
  equal); ``sync_mode="gradients"``: the copies' gradients are averaged first, and all take the
  same step;
* ``sync_dtype="bf16"``: a reduction averages each copy's change since the last one, rounded to
  bf16, and adds it to the reference (what every copy held after that reduction);
  ``sync_dtype="int8"``: the same for the rows some copy updated since the last reduction, each
  copy's change plus its residual in int8 levels of a per-row scale (a quarter power of two) that
  covers every copy, the residual keeping what rounding dropped (``replication.quantized``); the
  states of ``SparseOptimizerConfig.exact_states`` (the Adam family's second moment and step count)
  are averaged in fp32 whatever the wire, as the strategy sends them;
* fp16 tables (``EmbeddingTableConfig(dtype="fp16")``): each copy's rows are fp16, its states fp32;
  the lookups read the rows in fp32, the gradients are fp32 and each update is written back rounded to
  nearest (``sparse_update``); a reduction averages the fp16 rows as they are, on every wire
  (``replication.wire``), into the mean rounded to fp16 (the strategy sums them in fp16 over the copies:
  the same for 2 copies, within an fp16 rounding of it for more); ``MeshEmulator(sum_dtype="fp16")``
  sums them in fp16 too, one copy after another (``M - 1`` roundings; the collective's order is its own);
* ``sync_overlap``: a reduction is computed from the copies as they are after the step that
  launches it and applied when the next one is due (``sync_interval`` steps later), before that one
  is computed: ``(w - w_launch) + mean``, exactly the mean where a copy did not change the row
  meanwhile (``replication.rounds``); on the bf16 wire, ``w + (mean change - the copy's sent
  change)``, which leaves each copy what rounding kept of its change off the wire; validation and
  the end of fit apply it and complete a reduction (``drain``), which leaves the copies identical.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from lightning_twod.core.mesh import check_group_size
from lightning_twod.replication.quantized import (
    change_with_residual,
    exponents,
    keep_residual,
    levels,
    mean_change,
    quantize,
    row_steps,
)
from lightning_twod.replication.schedule import SyncSchedule
from lightning_twod.replication.wire import WIRE_DTYPES
from lightning_twod.sparse.modules import TableCollection
from lightning_twod.sparse.optimizers import SparseOptimizerConfig, sparse_update
from lightning_twod.sparse.wrap import find_embedding_modules


@dataclass(frozen=True)
class EmulatedLayout:
    """``world_size`` ranks in groups of ``shard_group_size``; how the groups are kept in sync.

    ``data_parallel``: names of the tables replicated on every rank (the strategy's
    ``sharding={name: "data_parallel"}``; a plain ``nn.Embedding(Bag)`` is named by its attribute path).
    ``group_sizes``: ``(table, S_t)`` pairs of the tables sharded in groups of their own size.
    """

    world_size: int
    shard_group_size: int
    sync_mode: str = "weights"
    sync_interval: int = 1
    data_parallel: tuple[str, ...] = ()
    sync_dtype: str = "fp32"
    sync_overlap: bool = False
    group_sizes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for table, size in (("every table", self.shard_group_size), *self.group_sizes):
            check_group_size(size, self.world_size, table)
        if self.sync_mode not in ("weights", "gradients"):
            raise ValueError(f"sync_mode={self.sync_mode!r}; use 'weights' or 'gradients'")
        if self.sync_dtype not in WIRE_DTYPES:
            raise ValueError(f"sync_dtype={self.sync_dtype!r}; use one of {tuple(WIRE_DTYPES)}")

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.shard_group_size

    def size_of(self, table: str) -> int:
        """The shard group size of ``table``: its own, else ``shard_group_size``."""
        return dict(self.group_sizes).get(table, self.shard_group_size)


def _table_name(path: str, module: nn.Module, param_name: str) -> str:
    """The strategy's name of the table behind a parameter: ``"t"`` of ``embedding_bags.t.weight``,
    or the attribute path of a plain ``nn.Embedding(Bag)``."""
    if isinstance(module, TableCollection):
        return param_name.split(".")[1]
    return path


class MeshEmulator:
    """Trains ``model`` (unsharded) as ``TwoDSparseStrategy`` would on ``layout``.

    ``loss_fn(model, batch)`` returns the mean loss of a local batch; ``dense_optimizer`` builds the
    dense optimizer from the dense parameters (the user's ``configure_optimizers`` minus tables).
    ``sparse`` updates the sharded tables, ``data_parallel_sparse`` (default: ``sparse``) the
    data-parallel ones, ``sparse_by_size`` (default: ``sparse``) the tables in groups of their own
    size, ``sparse_by_table`` the tables named there (the strategy's ``sparse_per_table``), over all of
    those; ``sparse.optimizers.layout_optimizer`` gives the strategy's configs.

    ``sum_dtype``: how a reduction averages the copies of fp16 rows ``[R, D]``: ``"fp32"`` (default) their
    mean rounded to fp16 once; ``"fp16"`` their sum in fp16, one copy after another, divided by the number
    of copies, each operation rounded to fp16, as the strategy's all-reduce of fp16 rows does (the same for
    2 copies). fp32 tensors are averaged in fp32 either way.
    """

    def __init__(self, model: nn.Module, layout: EmulatedLayout, sparse: SparseOptimizerConfig,
                 loss_fn: Callable[[nn.Module, dict], Tensor],
                 dense_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 data_parallel_sparse: SparseOptimizerConfig | None = None,
                 sparse_by_size: Mapping[int, SparseOptimizerConfig] | None = None,
                 sparse_by_table: Mapping[str, SparseOptimizerConfig] | None = None, sum_dtype: str = "fp32") -> None:
        if sum_dtype not in ("fp32", "fp16"):
            raise ValueError(f"MeshEmulator: sum_dtype={sum_dtype!r}; use 'fp32' (the mean of fp16 rows rounded "
                             "once) or 'fp16' (their sum in fp16, as the strategy's all-reduce)")
        self.model, self.layout, self.sparse, self.loss_fn = model, layout, sparse, loss_fn
        self.sum_dtype = sum_dtype
        self.tables: dict[str, nn.Parameter] = {}
        names: dict[str, str] = {}
        for path, module in find_embedding_modules(model):
            for name, param in module.named_parameters():
                key = f"{path}.{name}" if path else name
                self.tables[key], names[key] = param, _table_name(path, module, name)
        unknown = sorted(set(layout.data_parallel) - set(names.values()))
        if unknown:
            raise ValueError(f"data_parallel names unknown tables {unknown}; the tables are {sorted(set(names.values()))}")
        self.data_parallel = {key for key, table in names.items() if table in layout.data_parallel}
        self.sizes = {key: layout.size_of(table) for key, table in names.items()}
        by_size = dict(sparse_by_size or {})
        by_table = dict(sparse_by_table or {})
        self.configs = {key: by_table.get(names[key]) or ((data_parallel_sparse or sparse) if key in self.data_parallel
                                                          else by_size.get(self.sizes[key], sparse))
                        for key in self.tables}
        table_ids = {id(p) for p in self.tables.values()}
        self.dense = [p for p in model.parameters() if id(p) not in table_ids]
        self.optimizer = dense_optimizer(self.dense)
        self.copies: dict[str, list[Tensor]] = {}
        # per key, per state name (``state_shapes``'s, in its order), every copy's state
        self.states: dict[str, dict[str, list[Tensor]]] = {}
        for key, param in self.tables.items():
            count = 1 if layout.sync_mode == "gradients" else self.num_copies(key)
            self.copies[key] = [param.detach().clone() for _ in range(count)]
            shapes = self.configs[key].state_shapes(*param.shape)
            self.states[key] = {name: [torch.zeros(shape) for _ in range(count)] for name, shape in shapes.items()}
        # bf16 and int8 wires: per key, the reference of each piece on the wire (weights, then states)
        self.references = ({key: {name: per_copy[0].clone() for name, per_copy in self._wired(key)}
                            for key in self.copies} if layout.sync_dtype != "fp32" else {})
        # int8 wire: per key, every copy's residual of each piece on the wire
        self.residuals = ({key: [{name: torch.zeros_like(per_copy[0]) for name, per_copy in self._wired(key)}
                                 for _ in self.copies[key]] for key in self.copies}
                          if layout.sync_dtype == "int8" else {})
        self.touched = {key: torch.zeros(param.shape[0], dtype=torch.bool) for key, param in self.tables.items()}
        self.in_flight: dict | None = None  # a launched reduction: per key, launched copies and the mean
        self.sent: dict[str, dict[str, tuple[Tensor, Tensor]]] = {}  # bf16: per key, per piece: (sent, mean change)
        # bf16: per key, the rows an overlapped round left a residual in (the next round that waits sends them)
        self.sent_rows: dict[str, Tensor] = {}
        self.owed = {key: torch.zeros(param.shape[0], dtype=torch.bool) for key, param in self.tables.items()}
        # the strategy's schedule: a round every sync_interval steps (sync_mode="weights")
        self.schedule = SyncSchedule(layout.sync_interval, layout.sync_overlap, rounds=layout.sync_mode == "weights")

    def _pieces(self, key: str) -> list[tuple[str, list[Tensor]]]:
        """``(name, every copy's tensor)`` of the table ``key``: the weights, then each state."""
        return [("weight", self.copies[key]), *self.states[key].items()]

    def _wired(self, key: str) -> list[tuple[str, list[Tensor]]]:
        """The pieces a bf16 or int8 wire carries: all but the ``exact_states``, sent in fp32, and fp16 rows,
        sent as they are."""
        exact = self.configs[key].exact_states
        return [(name, per_copy) for name, per_copy in self._pieces(key)
                if name not in exact and per_copy[0].dtype == torch.float32]

    def num_copies(self, key: str) -> int:
        """Copies of a table in ``sync_mode="weights"``: one per replica group, or per rank if data-parallel."""
        return self.layout.world_size if key in self.data_parallel else self.layout.world_size // self.sizes[key]

    def _use(self, rank: int, widened: bool = False) -> None:
        """Point the model's tables at the copies rank ``rank`` uses; ``widened``: fp16 copies as fp32 clones
        (for a lookup and its backward: the kernels read fp16 rows in fp32 and take fp32 gradients)."""
        for key, param in self.tables.items():
            copies = self.copies[key]
            index = 0 if len(copies) == 1 else rank if key in self.data_parallel else rank // self.sizes[key]
            param.data = copies[index].float() if widened else copies[index]

    def step(self, rank_batches: Sequence[dict]) -> float:
        """One optimizer step on ``W`` local batches (rank order); returns the mean loss."""
        layout = self.layout
        assert len(rank_batches) == layout.world_size, f"need {layout.world_size} local batches"
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        sharded = {key: [None] * self.num_copies(key) for key in self.tables if key not in self.data_parallel}
        local = {key: [None] * layout.world_size for key in self.data_parallel}
        for rank, batch in enumerate(rank_batches):
            self._use(rank, widened=True)
            for param in self.tables.values():
                param.grad = None
            loss = self.loss_fn(self.model, batch)
            (loss / layout.world_size).backward()  # dense: the mean over all ranks
            total += float(loss.detach())
            for key, param in self.tables.items():
                if param.grad is None:
                    continue
                if key in self.data_parallel:  # the rank's own local-batch gradient
                    local[key][rank] = param.grad * layout.world_size
                else:  # the mean over the group's ranks: M times the world mean's share, summed
                    group = rank // self.sizes[key]
                    grad = param.grad * self.num_copies(key)
                    sharded[key][group] = grad if sharded[key][group] is None else sharded[key][group] + grad
        self.optimizer.step()
        for key, grads in (*sharded.items(), *local.items()):
            grads = [g for g in grads if g is not None] if layout.sync_mode == "gradients" else grads
            if layout.sync_mode == "gradients":
                if grads:  # copies that saw nothing contribute zero to the mean
                    self._sparse_step(key, 0, sum(grads) / (self.num_copies(key)))
                continue
            for copy, grad in enumerate(grads):
                if grad is not None:
                    self._sparse_step(key, copy, grad)
        if self.schedule.step():  # applies a launched reduction first
            self.reduce(wait=self.schedule.waits())
        self._use(0)
        return total / layout.world_size

    @torch.no_grad()
    def _sparse_step(self, key: str, copy: int, grad: Tensor) -> None:
        config = self.configs[key]
        rows = grad.abs().sum(dim=1).nonzero().squeeze(1)  # zero-gradient rows are no-ops anyway
        state = {name: per_copy[copy] for name, per_copy in self.states[key].items()}
        sparse_update(config, self.copies[key][copy], state, rows, grad[rows])
        self.touched[key][rows] = True

    @torch.no_grad()
    def _means(self, settle: bool) -> dict[str, dict[str, Tensor]]:
        """Per key, the reduction's result for each piece (``_pieces``), from the copies as they are;
        ``settle`` (a round that waits): bf16 rounds send the owed rows too."""
        means = {}
        for key in self.copies:
            rows = self.touched[key] | self.owed[key] if settle else self.touched[key].clone()  # bf16: the rows sent
            wired = dict(self._wired(key)) if self.layout.sync_dtype != "fp32" else {}
            means[key] = {}
            for name, per_copy in self._pieces(key):
                if len(per_copy) == 1:  # a table with one copy takes no part in the reduction
                    means[key][name] = per_copy[0].clone()
                elif name not in wired:  # the fp32 wire, a state sent in fp32 whatever the wire, or fp16 rows
                    means[key][name] = self._mean(per_copy)
                elif self.layout.sync_dtype == "int8":
                    means[key][name] = self._int8_mean(key, name, per_copy, self.references[key][name])
                else:
                    reference = self.references[key][name]
                    changes = torch.stack([(c - reference).to(torch.bfloat16) for c in per_copy])
                    changes[:, ~rows] = 0  # rows no copy touched are not sent
                    self.sent_rows[key] = rows
                    change = changes.sum(dim=0).float() / len(per_copy)
                    self.sent.setdefault(key, {})[name] = (changes, change)
                    means[key][name] = reference + change
            self.touched[key].zero_()
        return means

    def _mean(self, per_copy: list[Tensor]) -> Tensor:
        """The copies' mean; of fp16 rows with ``sum_dtype="fp16"``: their sum in fp16, divided in fp16."""
        if self.sum_dtype == "fp16" and per_copy[0].dtype == torch.float16:
            total = per_copy[0].clone()
            for copy in per_copy[1:]:
                total += copy  # each sum rounded to fp16
            return total.div_(len(per_copy))
        return torch.stack(per_copy).mean(dim=0)

    def _int8_mean(self, key: str, name: str, per_copy: list[Tensor], reference: Tensor) -> Tensor:
        """The int8 round of ``replication.quantized`` on the updated rows of piece ``name``; moves the residuals."""
        rows, count, mean = self.touched[key].nonzero().squeeze(1), len(per_copy), reference.clone()
        base = reference[rows].view(rows.numel(), -1)
        residuals = [self.residuals[key][copy][name] for copy in range(count)]
        changes = [change_with_residual(r[rows].view_as(base), c[rows].view_as(base), base, torch.empty_like(base))
                   for c, r in zip(per_copy, residuals, strict=True)]
        steps, inverse = row_steps(torch.stack([exponents(c) for c in changes]).amax(dim=0), levels(count))
        summed = torch.zeros_like(base)
        for change, residual in zip(changes, residuals, strict=True):
            sent = quantize(change, inverse, levels(count), torch.empty_like(change))
            summed += sent
            residual[rows] = keep_residual(change, sent, steps).view_as(residual[rows])
        mean[rows] = mean_change(summed, steps, count).add_(base).view_as(mean[rows])
        return mean

    @torch.no_grad()
    def reduce(self, wait: bool = True) -> None:
        """The cross-group reduction; ``wait=False`` launches it (applied by ``finish``). The interval restarts."""
        self.finish()
        self.sent = {}
        means = self._means(settle=wait)
        self.schedule.restart()
        if wait:  # every copy takes the mean
            for owed in self.owed.values():
                owed.zero_()
            for key, new in means.items():
                for name, per_copy in self._pieces(key):
                    per_copy[:] = [new[name].clone() for _ in per_copy]
                if self.references:
                    self.references[key] = {name: new[name].clone() for name in self.references[key]}
            self._use(0)
            return
        self.in_flight = {key: ({name: [c.clone() for c in per_copy] for name, per_copy in self._pieces(key)}, mean)
                          for key, mean in means.items()}

    @torch.no_grad()
    def finish(self) -> None:
        """Apply a launched reduction: ``(w - w_launch) + mean``, the mean on rows not changed since; on
        the bf16 wire ``w + (mean change - sent change)`` for the pieces it carries."""
        if self.in_flight is None:
            return
        for key, (launched, mean) in self.in_flight.items():
            for name, per_copy in self._pieces(key):
                for copy, (now, start) in enumerate(zip(per_copy, launched[name], strict=True)):
                    if name in self.sent.get(key, {}):
                        sent, change = self.sent[key][name]
                        per_copy[copy] = now + (change - sent[copy].float())
                        self.owed[key] |= self.sent_rows[key]
                    else:
                        per_copy[copy] = (now - start) + mean[name]
            if self.references:
                self.references[key] = {name: mean[name].clone() for name in self.references[key]}
        self.in_flight = None
        self._use(0)

    def drain(self) -> None:
        """What validation and the end of fit do: apply a launched reduction, then reduce what changed
        since; on the int8 wire, the copies' mean residual then goes into every copy and the reference
        (``quantized.sum_residuals``, ``add_residuals``)."""
        unsettled = self.in_flight is not None and bool(self.sent)  # bf16: residuals left in the copies
        self.finish()
        if self.schedule.owed or unsettled:
            self.reduce(wait=True)
        for key, owed in self.residuals.items():
            for name, per_copy in self._wired(key):
                mean = torch.stack([residuals[name] for residuals in owed]).mean(dim=0)
                per_copy[:] = [t + mean for t in per_copy]
                self.references[key][name] = self.references[key][name] + mean
            self.residuals[key] = [{name: torch.zeros_like(r) for name, r in residuals.items()} for residuals in owed]
        self._use(0)

    @contextmanager
    def drained(self) -> Iterator[None]:
        """The model as a drain leaves it, for the block only: the copies, references and interval
        are restored afterwards (an evaluation that does not change the run)."""
        saved = ({k: list(v) for k, v in self.copies.items()},
                 {k: {name: list(v) for name, v in states.items()} for k, states in self.states.items()},
                 {k: dict(v) for k, v in self.references.items()}, self.in_flight, replace(self.schedule),
                 {k: [{name: t.clone() for name, t in r.items()} for r in v] for k, v in self.residuals.items()},
                 {k: v.clone() for k, v in self.touched.items()}, dict(self.sent), dict(self.sent_rows),
                 {k: v.clone() for k, v in self.owed.items()})
        self.drain()
        try:
            yield
        finally:
            (self.copies, self.states, self.references, self.in_flight, self.schedule,
             self.residuals, self.touched, self.sent, self.sent_rows, self.owed) = saved
            self._use(0)
