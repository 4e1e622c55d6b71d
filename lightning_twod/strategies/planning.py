"""The planning half of ``TwoDSparseEngine``: the model's tables, the layout and plans, the mesh.

``MeshPlanning`` is mixed into the engine (which holds ``options``, ``host`` and the mesh state it
fills): ``check_before_launch`` checks what the configuration alone decides, before any process
starts; ``_plan_mesh`` plans the tables with decisions every rank shares and builds one mesh per
group size of the plan (a collective); ``plan_layout`` and ``table_rows`` are what ``lightning-twod
plan`` prints. The batch the planner predicts for is ``planner_batch_size``, else ``batch_size_of``
the module and its data; the tables' lookup statistics are ``lookup_stats``'s, over those estimated
from the first training batch (``first_batch``; rank 0's, shared with every rank) where it is ``"auto"``
and the layout is chosen by cost.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import lightning
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_info
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_twod.core.kjt import as_features
from lightning_twod.core.mesh import AUTO_GROUP_SIZE, check_group_size
from lightning_twod.core.shards import ShardingType, TableChoice, TableSharding
from lightning_twod.distributed import MeshGroups, SparseParallelDims, has_process_group
from lightning_twod.distributed.comm import ByteCounter
from lightning_twod.distributed.consensus import agree_min, check_same, raise_on_every_rank
from lightning_twod.hardware.machine import memory_per_rank_bytes
from lightning_twod.hardware.resolve import planning_links
from lightning_twod.planner import DenseModel, PlanRequest, ShardingPlan, StrategyPlan, plan_for_strategy
from lightning_twod.planner.evaluate import TableRow, table_rows
from lightning_twod.planner.inputs import ROW_NORM_OPTIMIZERS, Workload, column_wise_refusal
from lightning_twod.planner.layout import check_known_tables, specs_from_configs, split_choices
from lightning_twod.planner.links import resolve_links
from lightning_twod.planner.lookup_stats import STAT_FIELDS, describe_stats, estimate_lookup_stats
from lightning_twod.sparse.kernels import fbgemm_available, resolve_backend
from lightning_twod.sparse.pipeline import sparse_leaves
from lightning_twod.sparse.wrap import embedding_tables

#: Samples per rank the planner assumes when neither the strategy nor the data says.
DEFAULT_PLANNER_BATCH = 512


def batch_size_of(*sources: Any) -> int:
    """The first ``batch_size`` (samples per rank) found on ``sources`` or their ``hparams``, where
    Lightning's batch size finder looks too; ``DEFAULT_PLANNER_BATCH`` without one."""
    for source in sources:
        for holder in (source, getattr(source, "hparams", None)):
            value = getattr(holder, "batch_size", None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return DEFAULT_PLANNER_BATCH


def builds_at_setup(module: nn.Module) -> bool:
    """Whether ``module`` is a LightningModule with its own ``configure_model`` (or the older
    ``configure_sharded_model``): Lightning's hooks for building layers at set-up, on the right device.
    Lightning's own test (``is_overridden``), so a hook set on the instance or wrapped counts as it does there."""
    return isinstance(module, lightning.pytorch.LightningModule) and any(
        is_overridden(hook, module) for hook in ("configure_model", "configure_sharded_model"))



def world_group():
    """The default process group, or None without one (a single process)."""
    return dist.group.WORLD if has_process_group() else None


#: What to do where no statistics are sampled (a clause of the plan's log line).
STATS_FIX = f"give lookup_stats={{table: {{{', '.join(STAT_FIELDS)}}}}}"


def train_loader(module: nn.Module, datamodule: Any = None) -> tuple[Any, str]:
    """``(the train dataloader of the data a fit of module reads, "")``: ``datamodule``'s (``lightning-twod
    plan``), else what the Trainer fits on (``fit_loop``'s source: the datamodule, the loaders given to
    ``fit``, or the module's ``train_dataloader``); ``(None, why not)`` without one, or outside ``fit``
    (a datamodule may set up its training data for fit only)."""
    if isinstance(datamodule, lightning.pytorch.LightningDataModule) and is_overridden("train_dataloader", datamodule):
        return datamodule.train_dataloader(), ""
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        if trainer.state.fn != TrainerFn.FITTING:
            return None, f"{getattr(trainer.state.fn, 'value', 'no stage')} reads no training data"
        data = trainer.fit_loop._data_source
        if data.instance is None or not data.is_defined():
            return None, "no train dataloader"
        return data.dataloader(), ""
    if isinstance(module, lightning.pytorch.LightningModule) and is_overridden("train_dataloader", module):
        return module.train_dataloader(), ""
    return None, "no train dataloader at set-up"


def first_batch(loader: Any) -> tuple[Any, str]:
    """The first batch ``loader`` (a ``DataLoader``) gives, built from its map-style dataset and
    ``collate_fn`` without iterating the loader or its sampler (which would start workers and move the
    global random state): ``collate_fn(dataset[0])`` where it does not batch (and its sampler gives single
    ints), else ``collate_fn`` of the first ``batch_size`` samples. ``(None, why not)`` where it cannot be
    built so."""
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

    if not isinstance(loader, DataLoader):
        return None, f"the train dataloader is a {type(loader).__name__}, not one DataLoader"
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        return None, "the training data is an IterableDataset (its first batch is not read without iterating it)"
    if loader.batch_sampler is None:  # each index is a batch: only a sampler of single ints says index 0 is one
        if not isinstance(loader.sampler, (SequentialSampler, RandomSampler, DistributedSampler)):
            return None, f"the train dataloader's {type(loader.sampler).__name__} chooses what a batch's index is"
        return loader.collate_fn(dataset[0]), ""
    size = getattr(loader.batch_sampler, "batch_size", None)
    if not isinstance(size, int):
        return None, f"the train dataloader's {type(loader.batch_sampler).__name__} has no batch_size"
    size = min(size, len(dataset)) if hasattr(dataset, "__len__") else size
    if size < 1:
        return None, "the training data is empty"
    return loader.collate_fn([dataset[i] for i in range(size)]), ""


def check_known_stat_tables(given: Mapping[str, Any], names: set[str], option: str = "lookup_stats") -> None:
    """Raise ``ValueError`` naming the tables of ``given`` (the per-table entries of ``option``) not in ``names``
    (the model's)."""
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"{option} names unknown tables {unknown}; the model's tables are {sorted(names)}")


def check_column_wise(plans: Mapping[str, Mapping[str, TableSharding]], optimizer_of) -> None:
    """Raise ``ValueError`` naming a table that ``plans`` cut by columns (a ``plan`` file can) whose sparse
    optimizer (``optimizer_of(table)``) reads whole rows (``ROW_NORM_OPTIMIZERS``)."""
    for plan in plans.values():
        for table, sharding in plan.items():
            if sharding.sharding_type == ShardingType.COLUMN_WISE and optimizer_of(table) in ROW_NORM_OPTIMIZERS:
                raise ValueError(column_wise_refusal(optimizer_of(table), f"the plan cuts table {table!r} column_wise"))


def sample_lookup_stats(tables_by_module: Mapping[str, list], batch: Any) -> dict[str, dict[str, Any]]:
    """``estimate_lookup_stats`` of every table of ``tables_by_module`` (``embedding_tables``) on the
    ``SparseFeatures`` / ``KeyedJaggedTensor`` objects of ``batch`` (the first that holds a table's features)."""
    tables = {t.name: (t.num_embeddings, list(t.feature_names)) for ts in tables_by_module.values() for t in ts}
    stats: dict[str, dict[str, Any]] = {}
    for features in sparse_leaves(batch):
        for table, entry in estimate_lookup_stats(features, tables).items():
            stats.setdefault(table, entry)
    return stats


class MeshPlanning:
    """Plans a model's tables and builds the mesh; mixed into ``TwoDSparseEngine``, whose ``options``,
    ``host``, ``collective_timeout`` and mesh state (``sharding_plan``, ``_plans``, ``_groups``,
    ``_groups_of_size``, ``byte_counter``, ``_backend``) it reads and fills."""

    def check_before_launch(self, module: nn.Module | None = None) -> None:
        """What the configuration alone decides, checked before any process starts: the group sizes (the
        global one and each table's) against ``num_nodes x devices``, where the Trainer is made; with
        ``module`` (the model the launcher is about to run), also that ``sharding`` and ``lookup_stats``
        name only its tables, with set-up's message. A module with a ``configure_model`` of its own may build tables
        there, at set-up: its names are checked then only."""
        world, size = self.host.world_size, self.options.shard_group_size
        try:
            if size != AUTO_GROUP_SIZE:
                check_group_size(size, world)
            split_choices(self.options.table_choices, world)
        except ValueError as err:
            raise MisconfigurationException(
                f"{type(self).__name__}: {err} (world_size = num_nodes x devices = {self.host.num_nodes} x "
                f"{self.host.num_processes}); change shard_group_size or the devices and nodes"
            ) from None
        given_stats = self.options.lookup_stats if isinstance(self.options.lookup_stats, Mapping) else {}
        per_table = self.options.sparse_per_table
        if module is None or builds_at_setup(module) or not (self.options.sharding or given_stats or per_table):
            return
        try:
            specs = specs_from_configs(embedding_tables(module))
            check_known_tables(specs, self.options.sharding)
            names = {spec.name for module_specs in specs.values() for spec in module_specs}
            check_known_stat_tables(given_stats, names)
            check_known_stat_tables(per_table, names, "sparse_per_table")
        except ValueError as err:
            raise MisconfigurationException(f"{type(self).__name__}: {err}") from None

    def _plan_mesh(self, module: nn.Module) -> None:
        """Plan the tables of ``module`` and build the mesh: one decision for every rank; a collective.

        Each decision is taken from numbers every rank shares, and each step that can fail fails on
        every rank at once: a rank left behind would wait in the next collective.
        """
        options, host = self.options, self.host
        world, group = host.world_size, world_group()
        with raise_on_every_rank(group):  # (the group sizes were checked before launch: check_before_launch)
            self._tables_of(module)
            local = (self.memory_budget(), float(fbgemm_available()))
            sampled = self._sample_stats(module) if group is None or dist.get_rank(group) == 0 else ("", "")
        budget, fbgemm_everywhere = agree_min(local, group)
        self._sampled_stats = _from_rank_0(sampled, group)  # every rank plans on rank 0's sample
        links = planning_links(options.links, group, host.num_processes, host.root_device, self.layout_by_cost)
        with raise_on_every_rank(group):
            planned = self.plan_layout(module, budget, links)
            self._backend, self._backend_reason = self.backend_for(planned, bool(fbgemm_everywhere))
        check_same("sharding plan", f"{planned.plan.to_yaml()}\nbackend={self._backend}", group)
        self.sharding_plan, self._plans = planned.plan, planned.plans
        rank_zero_info(f"{type(self).__name__}: {planned.explanation}")
        sizes = sorted({planned.group_size, *planned.plan.group_sizes()})
        self._groups_of_size = {  # every rank creates every mesh, in the same order
            size: MeshGroups.create(SparseParallelDims(world, size, planned.plan.placement, ranks_per_node=host.num_processes),
                                    device_type=host.root_device.type, timeout=self.collective_timeout)
            for size in sizes}
        self._groups = self._groups_of_size[planned.group_size]
        self.byte_counter = ByteCounter(host.global_rank, world)

    @property
    def layout_by_cost(self) -> bool:
        """Whether the planner chooses group size or placement by predicted step time."""
        return self.options.shard_group_size == AUTO_GROUP_SIZE or self.options.placement == "auto"

    @property
    def samples_lookup_stats(self) -> bool:
        """Whether set-up estimates lookup statistics from the first training batch: ``lookup_stats`` is not
        None and the layout is chosen by cost."""
        return self.options.lookup_stats is not None and self.layout_by_cost

    def _tables_of(self, module: nn.Module) -> dict[str, list]:
        tables = embedding_tables(module)
        if not tables:
            raise MisconfigurationException(
                f"{type(self).__name__} found no embedding tables in {type(module).__name__}: add an "
                "EmbeddingBagCollection, EmbeddingCollection, nn.EmbeddingBag or nn.Embedding, or use "
                "strategy='ddp' for a model without sparse features"
            )
        return tables

    def plan_layout(self, module: nn.Module, budget: float, links, datamodule: Any = None, *,
                    shard_group_size: int | str | None = None, placement: str | None = None,
                    own_sizes: bool = True) -> StrategyPlan:
        """The layout and plans of ``module``'s tables on this strategy's world (no collective).

        ``budget``: bytes a rank may hold; ``links``: the ``LinkModel`` to predict on;
        ``shard_group_size`` / ``placement``: in place of the options'; ``own_sizes=False``: every table
        in groups of that size, whatever ``sharding`` gives it (a global layout to compare with). The batch is
        ``planner_batch_size``, else ``batch_size_of`` the module and the data (``datamodule``, else
        the trainer's); the lookup statistics are ``lookup_stats``'s, and the explanation's first line
        ends with which. ``lightning-twod plan`` calls this too, so it prints what set-up logs.
        """
        options = self.options
        tables, workload, dense = self._planning_inputs(module, datamodule)
        stats, stats_note = self.lookup_stats(module, datamodule)
        request = PlanRequest(
            self.host.world_size, self.host.num_processes, budget, workload,
            shard_group_size=options.shard_group_size if shard_group_size is None else shard_group_size,
            placement=options.placement if placement is None else placement,
            constraints=options.table_choices if own_sizes else {t: TableChoice(c.sharding_type) for t, c in
                                                                  options.table_choices.items() if c.sharding_type},
            stats=stats, pinned=options.plan, links=links, dense=dense,
        )
        try:
            check_known_stat_tables(options.sparse_per_table, {t.name for ts in tables.values() for t in ts},
                                    "sparse_per_table")
            planned = plan_for_strategy(tables, request)
            check_column_wise(planned.plans, workload.optimizer_of)
        except (ValueError, RuntimeError) as err:
            raise MisconfigurationException(f"{type(self).__name__}: {err}") from err
        head, _, rest = planned.explanation.partition("\n")
        return planned._replace(explanation=f"{head}; {stats_note}" + (f"\n{rest}" if rest else ""))

    #: ``(json of the sampled statistics, why none)`` once taken (``_sample_stats``), shared by every rank.
    _sampled_stats: tuple[str, str] | None = None

    def lookup_stats(self, module: nn.Module, datamodule: Any = None) -> tuple[dict[str, dict[str, Any]], str]:
        """The lookup statistics the planner predicts with (``options.lookup_stats``' mapping over the
        sample's, ``_sample_stats``) and a clause saying which they are, for the plan's log line. The
        sample is taken once (set-up shares rank 0's: ``_plan_mesh``); ``lightning-twod plan`` takes it here,
        from ``datamodule``'s train dataloader. Raises ``MisconfigurationException`` for given tables the
        model does not have."""
        given = self.options.lookup_stats
        if given is None:
            return {}, "lookup stats: none (lookup_stats=None: one id a feature, uniform)"
        names = {t.name for ts in self._tables_of(module).values() for t in ts}
        given = given if isinstance(given, Mapping) else {}
        try:
            check_known_stat_tables(given, names)
        except ValueError as err:
            raise MisconfigurationException(f"{type(self).__name__}: {err}") from None
        if self._sampled_stats is None:
            self._sampled_stats = self._sample_stats(module, datamodule)
        text, source = self._sampled_stats
        sampled = json.loads(text) if text else {}
        stats = {t: {**sampled.get(t, {}), **given.get(t, {})} for t in sorted(names) if t in sampled or t in given}
        sources = [source] if source else []
        if given:
            sources.append(f"given for {len(given)} table(s)")
        described = describe_stats(stats) if stats else "one id a feature, uniform"
        return stats, f"lookup stats: {described}" + (f" ({'; '.join(sources)})" if sources else "")

    def _sample_stats(self, module: nn.Module, datamodule: Any = None) -> tuple[str, str]:
        """``(json of the statistics of the first training batch, where they come from)``, or ``("", why
        none and the fix)``: sampled only with ``lookup_stats`` not None and the layout chosen by cost."""
        if not self.samples_lookup_stats:
            return "", "none sampled: the layout is fixed" if self.options.lookup_stats is not None else ""
        loader, why_not = train_loader(module, datamodule)
        batch, why_not = first_batch(loader) if loader is not None else (None, why_not)
        if batch is None:
            return "", f"{why_not}: none sampled ({STATS_FIX})"
        stats = sample_lookup_stats(self._tables_of(module), batch)
        if not stats:
            return "", f"the first training batch holds no ids of the tables' features ({STATS_FIX})"
        samples = as_features(sparse_leaves(batch)[0], "the first training batch").batch_size
        return json.dumps(stats, sort_keys=True), f"sampled from the first training batch, {samples} samples"

    def _planning_inputs(self, module: nn.Module, datamodule: Any) -> tuple[dict[str, list], Workload, DenseModel]:
        """``module``'s tables, the step the planner predicts (this run's options and batch) and the dense part."""
        tables = self._tables_of(module)
        table_params = sum(t.num_embeddings * t.embedding_dim for ts in tables.values() for t in ts)
        dense = DenseModel(max(0, sum(p.numel() for p in module.parameters()) - table_params))
        if datamodule is None:
            datamodule = getattr(getattr(module, "_trainer", None), "datamodule", None)
        batch = self.options.planner_batch_size or batch_size_of(module, datamodule)
        return tables, self.options.workload(batch), dense

    def table_rows(self, module: nn.Module, plan: ShardingPlan, links, datamodule: Any = None) -> list[TableRow]:
        """Per table of ``plan``: where it goes and what it alone costs (``evaluate.table_rows``), on this
        run's batch and options and ``links``."""
        tables, workload, _ = self._planning_inputs(module, datamodule)
        stats, _ = self.lookup_stats(module, datamodule)
        return table_rows(specs_from_configs(tables, stats), plan, workload, resolve_links(links))

    def backend_for(self, planned: StrategyPlan, fbgemm_everywhere: bool) -> tuple[str, str]:
        """``(backend, why)`` of the kernels of ``planned``'s shards (``kernel_backend`` resolved) for the
        sparse optimizer on this rank's device (FBGEMM fuses the Adam family on CUDA only, some not at all)."""
        widths = [shard.dim for plans in planned.plans.values() for sharding in plans.values()
                  for shard in sharding.shards]
        options = self.options
        optimizers = [settings.unscaled() for settings in (options.optimizer_settings, *options.table_optimizers.values())]
        try:
            return resolve_backend(options.kernel_backend, widths, fbgemm_everywhere, optimizers,
                                   self.host.root_device)
        except (ValueError, RuntimeError) as err:
            raise MisconfigurationException(f"{type(self).__name__}: {err}") from err

    def table_optimizer_summary(self) -> str:
        """``"sparse_per_table: 't_big': optimizer='rowwise_adam', lr=0.001"``: the settings of each table's own
        sparse optimizer that differ from the strategy's (what set-up logs and ``lightning-twod plan`` prints);
        "" without ``sparse_per_table``."""
        default = self.options.optimizer_settings
        own = [f"{table!r}: {settings.describe(default) or 'as the strategy'}"
               for table, settings in self.options.table_optimizers.items()]
        return f"sparse_per_table: {'; '.join(own)}" if own else ""

    def memory_budget(self) -> float:
        """Bytes this rank may spend on its shards: ``memory_per_rank_gb``, else its device's share."""
        if self.options.memory_per_rank_gb is not None:
            return self.options.memory_per_rank_gb * 2**30
        return memory_per_rank_bytes(self.host.root_device, self.host.num_processes)


def _from_rank_0(value: tuple[str, str], group) -> tuple[str, str]:
    """Rank 0's ``value`` on every rank of ``group`` (as it is without one)."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return tuple(box[0])
