"""One rank of ``scaling.py``'s TorchRec jobs: DMP 1D and ``DMPCollection`` (2D), many cells per job.

Started by torchrun with the project's Python, it re-executes itself with the TorchRec environment's
(``benchmarks/.venv-torchrec``, made by ``setup_torchrec.sh``) and without the project on its path.
Cells (``{"name", "system", "warmup", "steps", ...}``), the job file and the output lines are those
of ``scaling_workers.py``, whose torch-only helpers this worker shares:

* ``"torchrec_dmp"``: ``DistributedModelParallel``, table-wise over the whole world (as
  ``torchrec_worker.py`` for ``throughput.py``);
* ``"torchrec_dmpc"``: ``DMPCollection`` with ``sharding_group_size`` ``shard`` and
  ``use_inter_host_allreduce`` ``inter_host`` (False is TorchRec's default placement: a sharding
  group takes every ``world / shard``-th rank, so the replica groups are neighbours; True: a
  sharding group is consecutive ranks, so the replicas sit on other hosts), table-wise inside a
  sharding group, ``model.sync()`` (whole tables and their AdaGrad state averaged over the
  replica group) after every ``interval``-th step.

TorchRec 1.8.0's ``DMPCollection`` refuses a CPU device (an assertion that the device is CUDA or
MTIA), places remapped shards on ``cpu:<local rank>`` (which no CPU tensor's device equals) and
averages with ``ReduceOp.AVG``, which gloo lacks. ``CpuDMPCollection`` builds the same object
without that assertion (the steps of ``DMPCollection.__init__`` for its default context), places
the shards on ``cpu``, and averages by a coalesced gloo sum over the replica group, divided by its
size.

    python -m torch.distributed.run ... benchmarks/torchrec_collection_worker.py --job JOB.json
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(HERE, ".venv-torchrec")


def _in_torchrec_env() -> None:
    """Re-execute this script with the TorchRec environment's Python (same pid, same torchrun env)."""
    if os.path.realpath(sys.prefix) != os.path.realpath(VENV):
        python = os.path.join(VENV, "bin", "python")
        if not os.path.exists(python):
            raise SystemExit(f"{VENV} is missing: run `bash benchmarks/setup_torchrec.sh`")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not the project's packages
        os.execve(python, [python, os.path.abspath(__file__), *sys.argv[1:]], env)


if __name__ == "__main__":
    _in_torchrec_env()

import argparse  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, HERE)
import scaling_workers as SW  # noqa: E402
import torchrec_worker as TW  # noqa: E402
import workload as W  # noqa: E402


def cpu_dmp_collection():
    """``DMPCollection`` without its CUDA check, averaging by gloo sums (see the module docstring)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
    from torchrec.distributed.types import DMPCollectionContext, ShardingEnv2D, ShardingStrategy

    class CpuDMPCollection(DMPCollection):
        def __init__(self, module, device, plan, world_size, sharding_group_size, global_pg, sharders,
                     use_inter_host_allreduce: bool) -> None:
            self._device, self._pg = device, global_pg
            self._global_rank = dist.get_rank(global_pg)
            self._custom_all_reduce = self._gloo_average
            self._sharder_map = {sharder.module_type: sharder for sharder in sharders}
            ctx = DMPCollectionContext(module=None, plan=plan, sharding_group_size=sharding_group_size,
                                       node_group_size=None, use_inter_host_allreduce=use_inter_host_allreduce,
                                       sharding_strategy=ShardingStrategy.DEFAULT)
            self._default_ctx, self._submodule_ctxs, self._ctxs = ctx, [], [ctx]
            ctx.device_mesh, ctx.sharding_pg, ctx.replica_pg = self._create_process_groups(
                global_rank=self._global_rank, world_size=world_size, local_size=sharding_group_size,
                use_inter_host_allreduce=use_inter_host_allreduce)
            self._remap_sharding_plan(plan=plan, rank=self._global_rank, step=world_size // sharding_group_size,
                                      sharding_group_size=sharding_group_size,
                                      use_inter_host_allreduce=use_inter_host_allreduce)
            env = ShardingEnv2D(global_pg=global_pg, sharding_pg=ctx.sharding_pg, replica_pg=ctx.replica_pg,
                                device_mesh=ctx.device_mesh, node_group_size=None,
                                use_inter_host_allreduce=use_inter_host_allreduce,
                                sharding_strategy=ShardingStrategy.DEFAULT)
            DistributedModelParallel.__init__(self, module, env, device, plan, sharders)
            self._group_sharded_modules(self._ctxs)
            self._cache_sync_tensors(self._ctxs)
            self._use_sharded_relay, self._sharded_relay_state = False, None

        def _remap_sharding_plan(self, plan, **kwargs) -> None:
            """TorchRec's remapping, with the shards placed on ``cpu`` (it writes ``cpu:<local rank>``,
            which a CPU tensor's device never equals)."""
            from torch.distributed import _remote_device
            from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

            super()._remap_sharding_plan(plan=plan, **kwargs)
            for module_plan in plan.plan.values():
                for sharding in module_plan.values():
                    if isinstance(sharding.sharding_spec, EnumerableShardingSpec):
                        for shard in sharding.sharding_spec.shards or []:
                            shard.placement = _remote_device(f"rank:{shard.placement.rank()}/cpu")

        def _gloo_average(self, tensors: list[torch.Tensor]) -> None:
            group = self._default_ctx.replica_pg
            opts = dist.AllreduceCoalescedOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            group.allreduce_coalesced(tensors, opts).wait()
            size = dist.get_world_size(group)
            for tensor in tensors:
                tensor.div_(size)

        def sync_bytes(self) -> int:
            """Bytes this rank puts into one ``sync()``: its shards' weights and optimizer state."""
            ctx = self._default_ctx
            groups = [*ctx.weights_by_dtype.values(), *(ctx.optimizer_tensors_by_dtype or {}).values()]
            return sum(t.numel() * t.element_size() for tensors in groups for t in tensors)

    return CpuDMPCollection


def run_torchrec_cell(cell: dict, work: W.Workload, batches: list) -> dict:
    """Trains one TorchRec cell in a plain loop; the rank's report."""
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType

    world = dist.get_world_size()
    collection = cell["system"] == "torchrec_dmpc"
    model = TW.build_model(work)
    sharder = EmbeddingBagCollectionSharder()
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
                   for t in model.sparse.embedding_bag_configs()}
    group = cell["shard"] if collection else world
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=group, local_world_size=group,
                                                         compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    if collection:
        dmp = cpu_dmp_collection()(model, torch.device("cpu"), plan, world, cell["shard"], dist.GroupMember.WORLD,
                                   [sharder], cell["inter_host"])
    else:
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_optimizer = TW.dense_adam(dmp, work)
    timer = W.load_phase_timer()()
    TW.time_phases(dmp, timer)
    counters = {"rounds": 0, "sync_s": 0.0, "payload_bytes": 0}
    window = SW.Window(cell["warmup"], cell["steps"], timer, lambda: dict(counters))

    dmp.train()
    for step, (dense, values, lengths, label) in enumerate(batches[:cell["warmup"] + cell["steps"]]):
        window.step_begin(step)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=work.keys, values=values, lengths=lengths)
        with timer.phase("forward"):
            loss = F.binary_cross_entropy_with_logits(dmp(dense, kjt), label)
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            dense_optimizer.step()
            dense_optimizer.zero_grad()
            if collection and (step + 1) % cell["interval"] == 0:
                start = time.perf_counter()
                with timer.phase("cross_group"):
                    dmp.sync()
                counters["sync_s"] += time.perf_counter() - start
                counters["rounds"] += 1
                counters["payload_bytes"] += dmp.sync_bytes()
        window.step_end(step)
    report = {**window.report(), "loss": float(loss), "rank": dist.get_rank()}
    if collection:
        ctx = dmp._default_ctx
        report["shard_ranks"] = dist.get_process_group_ranks(ctx.sharding_pg)
        report["replica_ranks"] = dist.get_process_group_ranks(ctx.replica_pg)
        SW.plain_for_round(report, torch.float32, ctx.replica_pg)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True, help="the job's JSON (written by scaling.py)")
    SW.run_job(parser.parse_args().job, run_torchrec_cell)
    dist.destroy_process_group()
    time.sleep(0.1)  # as torchrec_worker.py: let gloo's threads drop their last work before finalization


if __name__ == "__main__":
    main()
