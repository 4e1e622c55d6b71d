"""One rank of the TorchRec baseline of ``throughput.py`` (runs in ``benchmarks/.venv-torchrec``).

TorchRec 1.8.0 ``DistributedModelParallel``, 1D table-wise sharding over the whole world (the
planner constrained to ``table_wise``), FBGEMM's fused row-wise AdaGrad in backward
(``apply_optimizer_in_backward``), dense parameters in DDP with Adam: TorchRec's documented
training set-up, in a plain loop over the same batches as the other systems.

The model reads its lookup where the bundled ``DLRM`` reads ours: it calls the sharded collection
first, runs its bottom MLP while the pooled all-to-all travels, and reads the rows for the
interaction (TorchRec's output is a lazy awaitable, waited for where it is first read); the bare
model (``workload.py``) reads them at once, having nothing else to run.

Launched by ``throughput.py`` as ``world`` processes with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` set; ``--phases`` times input dist, lookup and output dist (a forward equal
to ``ShardedModule.forward``: input dist, compute, output dist launched and waited for where the
model reads it) and the dense all-reduce (a DDP comm hook). ``build_model``, ``dense_adam`` and ``time_phases`` also serve
``torchrec_collection_worker.py`` (``scaling.py``'s TorchRec cells).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload as W  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True)
    parser.add_argument("--batches", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = W.Workload.from_json(args.workload)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType

    model = build_model(work)
    sharder = EmbeddingBagCollectionSharder()
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value])
                   for t in model.sparse.embedding_bag_configs()}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=work.world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense_optimizer = dense_adam(dmp, work)

    timer = W.load_phase_timer()()
    clock = W.StepClock(work, timer)
    time_phases(dmp, timer)

    from torchrec import KeyedJaggedTensor

    batches = W.load_batches(args.batches, rank)
    lengths = torch.ones(work.num_tables * work.batch, dtype=torch.int64)
    dmp.train()
    for step, (dense, ids, label) in enumerate(batches):
        clock.step_begin(step)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=work.keys, values=ids.flatten(), lengths=lengths)
        with timer.phase("forward"):
            loss = F.binary_cross_entropy_with_logits(dmp(dense, kjt), label)
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            dense_optimizer.step()
            dense_optimizer.zero_grad()
        clock.step_end(step)
    W.write_report(args.out, rank, clock.report("torchrec_1d", rank, {"loss": float(loss)}))
    dist.barrier()
    dist.destroy_process_group()
    # DMP still holds its groups, so gloo's threads live on: give one that is still dropping the
    # barrier's work the GIL now, or it may abort the process during interpreter finalization
    # (what lightning_twod.distributed.destroy_process_groups_at_exit does for our ranks)
    time.sleep(0.1)


def build_model(work: W.Workload) -> nn.Module:
    """The model of ``workload.py`` (the DLRM, or the bare embedding path) with TorchRec's
    ``EmbeddingBagCollection`` (on ``meta``, for the sharder to materialize) and FBGEMM's row-wise
    AdaGrad fused into backward."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=work.dim, num_embeddings=rows, feature_names=[k])
              for k, rows in zip(work.keys, work.table_rows, strict=True)]

    class DLRM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bottom = W.mlp([W.NUM_DENSE, *work.bottom, work.dim])
            self.sparse = EmbeddingBagCollection(tables, device=torch.device("meta"))
            self.top = W.mlp([W.top_input_size(work), *work.top, 1], last_activation=False)

        def forward(self, dense, kjt):
            pooled = self.sparse(kjt)  # sharded: the rows travel while the bottom MLP runs
            bottom = self.bottom(dense)
            return W.interact(bottom, list(torch.split(pooled.values(), work.dim, dim=1)), self.top)

    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = EmbeddingBagCollection(tables, device=torch.device("meta"))
            self.head = W.bare_head(work)

        def forward(self, dense, kjt):
            return self.head(self.sparse(kjt).values()).squeeze(1)

    torch.manual_seed(work.seed)
    model = Bare() if work.model == "bare" else DLRM()
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse.parameters(),
                                {"lr": work.sparse_lr, "eps": work.sparse_eps})
    return model


def dense_adam(dmp: nn.Module, work: W.Workload):
    """Adam over the parameters that have no fused optimizer (the dense ones)."""
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                 lambda params: torch.optim.Adam(params, lr=work.dense_lr))


def time_phases(dmp: nn.Module, timer) -> None:
    """Replace the sharded collection's forward by ``ShardedModule.forward`` timed phase by phase
    (input dist, lookup, output dist: its launch, and its wait where the model first reads the
    result, as ours; the lookups' backward through hooks), and time DDP's all-reduce of the dense
    gradients."""
    sebc = dmp.module.sparse

    def timed_forward(features):
        timer.start("input_dist")
        ctx = sebc.create_context()
        dist_input = sebc.input_dist(ctx, features).wait().wait()
        timer.stop("input_dist")
        timer.start("lookup")
        embs = [lookup(f) for lookup, f in zip(sebc._lookups, dist_input)]
        timer.stop("lookup")
        for emb in embs:
            timer.time_backward(emb, "lookup_backward")
        timer.start("output_dist")
        out = sebc.output_dist(ctx, embs)  # a LazyAwaitable: waited for where it is first read
        timer.stop("output_dist")
        wait = out._wait_impl

        def timed_wait():
            timer.start("output_dist")
            result = wait()
            timer.stop("output_dist")
            return result

        out._wait_impl = timed_wait
        return out

    sebc.forward = timed_forward
    ddps = [m for m in dmp.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    if ddps:
        ddps[0].register_comm_hook(None, W.timed_allreduce_hook(timer))


if __name__ == "__main__":
    main()
