"""Quality parity of 2D sparse parallelism: the layout vs the optimizer, measured.

Trains the DLRM of ``examples/configs/movielens_2x2.yaml`` on MovieLens-100K (and optionally on the
SYNTHETIC planted-model clicks) under each configuration of ``CONFIGS``, several seeds, and a sweep
of sparse learning rates; reports validation AUC, NE and log loss (mean and spread over seeds) at
the sparse learning rate tuned for 1D (one shared value) and at each configuration's own best.

The runs use ``lightning_twod.testing.emulator.MeshEmulator``: the strategy's exact arithmetic for W ranks
in one process (checked against real multi-process runs by ``tests/system/test_emulation.py``), so that
hundreds of runs fit on a 2-core machine. Bytes per step come from the planner's traffic model
(checked against the byte counters of real runs within 5% by ``tests/system/test_planner_distributed.py``).

    python benchmarks/quality.py                      # full: 3 seeds, 4 learning rates, 1 epoch
    python benchmarks/quality.py --seeds 1 --epochs 1 --lrs 0.05 --configs 1d 2d_gradients  # quick
    python benchmarks/quality.py --optimizer rowwise_adam   # the Adam study: ADAM_CONFIGS, ADAM_LRS
    python benchmarks/quality.py --table-dtype fp16         # the fp16 study: FP16_CONFIGS, FP16_LRS

``--optimizer`` picks the study: ``rowwise_adagrad`` (the default: ``CONFIGS``, ``LRS``, the page
``quality.md``) or ``rowwise_adam`` (``ADAM_CONFIGS``, ``ADAM_LRS``, the page ``quality_adam.md``, the
cache ``quality_runs_adam.jsonl``); ``--table-dtype fp16`` the fp16 tables' study of row-wise AdaGrad
(``FP16_CONFIGS``, ``FP16_LRS``, the page ``quality_fp16.md``, the cache ``quality_runs_fp16.jsonl``).

Every finished run is appended to ``--cache`` (JSON lines; default
``benchmarks/out/quality_runs[_synthetic][_adam].jsonl``, git-ignored) and skipped when the command is run
again, so an interrupted benchmark resumes where it stopped. The page ``quality[_synthetic].md``
goes to ``--out`` (default ``benchmarks/results``, in git), its figure
``quality[_synthetic]_curves.png`` to the twin of ``--out`` under ``benchmarks/out`` (beside the
page when ``--out`` is not under ``benchmarks/results``: ``outputs.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from lightning_twod.cli.fit import LINKED_FROM_DATA
from lightning_twod.datasets import MovieLensDataModule
from lightning_twod.metrics import binary_auc
from lightning_twod.models.dlrm import DLRM
from lightning_twod.sparse.modules import EmbeddingBagCollection
from lightning_twod.sparse.optimizers import SparseOptimizerConfig
from lightning_twod.testing.emulator import EmulatedLayout, MeshEmulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # ``benchmarks.quality_report`` when run as a script
from benchmarks.outputs import OUT  # noqa: E402

CONFIG = ROOT / "examples" / "configs" / "movielens_2x2.yaml"
LOCAL_BATCH = 64  # samples per rank and step
LRS = (0.0125, 0.03, 0.08, 0.2)  # the sweep spans 16x in steps of about 2.5x
# SYNTHETIC Criteo-like data: 13 dense and 26 sparse features with power-law ids; tables smaller than
# examples/configs/synthetic_criteo_2x2.yaml's so that the emulated runs stay cheap.
SYNTHETIC_ROWS = [20000, 10000, 5000, 5000, 2000, 2000, 1000, 1000, 1000, 1000, 500, 500, 500, 500,
                  200, 200, 200, 200, 100, 100, 100, 100, 50, 50, 50, 50]
SYNTHETIC_TRAIN, SYNTHETIC_VAL = 80_000, 8_192
EPS = 1e-8


@dataclass(frozen=True)
class Config:
    """One training configuration: the mesh, its reduction, its sparse optimizer and its tables' dtype."""

    name: str
    world: int
    group: int
    optimizer: str = "rowwise_adagrad"
    scale: float = 1.0  # momentum scale c (momentum_rowwise_adagrad)
    sync_mode: str = "weights"
    sync_interval: int = 1
    what: str = ""
    sync_dtype: str = "fp32"  # payload of the reduction: "fp32", or "bf16" / "int8" (changes since the last one)
    sync_overlap: bool = False  # the reduction applied one step after its launch
    table_dtype: str = "fp32"  # the tables' rows: "fp32", or "fp16" (EmbeddingTableConfig.dtype; fp32 state)
    fp16_sum: bool = False  # fp16 rows: a round sums the copies in fp16 (MeshEmulator's sum_dtype), not their mean rounded once

    @property
    def replicas(self) -> int:
        return self.world // self.group


CONFIGS = [
    Config("single", 1, 1, what="one process, the global batch"),
    Config("1d", 4, 4, what="1D: 1 x 4, row-wise AdaGrad"),
    Config("2d_rowwise", 4, 2, what="2D: 2 x 2, row-wise AdaGrad"),
    Config("2d_momentum", 4, 2, "momentum_rowwise_adagrad", 2.0, what="2D, momentum scale c = M = 2"),
    Config("2d_momentum_c4", 4, 2, "momentum_rowwise_adagrad", 4.0, what="2D, momentum scale c = 4"),
    Config("2d_momentum_sync4", 4, 2, "momentum_rowwise_adagrad", 2.0, sync_interval=4,
           what="2D, c = 2, reduction every 4 steps"),
    Config("2d_momentum_sync16", 4, 2, "momentum_rowwise_adagrad", 2.0, sync_interval=16,
           what="2D, c = 2, reduction every 16 steps"),
    Config("2d_momentum_bf16", 4, 2, "momentum_rowwise_adagrad", 2.0, sync_dtype="bf16",
           what="2D, c = 2, bf16 changes on the wire"),
    Config("2d_momentum_int8", 4, 2, "momentum_rowwise_adagrad", 2.0, sync_dtype="int8",
           what="2D, c = 2, int8 changes with error feedback on the wire"),
    Config("2d_momentum_overlap", 4, 2, "momentum_rowwise_adagrad", 2.0, sync_overlap=True,
           what="2D, c = 2, reduction overlapped with the next step"),
    Config("2d_momentum_sync8", 4, 2, "momentum_rowwise_adagrad", 2.0, sync_interval=8,
           what="2D, c = 2, reduction every 8 steps"),
    Config("2d_momentum_sync8_overlap_bf16", 4, 2, "momentum_rowwise_adagrad", 2.0, sync_interval=8,
           sync_dtype="bf16", sync_overlap=True, what="2D, c = 2, every 8 steps, overlapped, bf16"),
    Config("2d_gradients", 4, 2, sync_mode="gradients", what="2D, gradients all-reduced every step (= 1D)"),
    Config("1d_momentum", 4, 4, "momentum_rowwise_adagrad", 2.0, what="1D with momentum scale 2 (no layout)"),
    # more replica groups: 8 ranks, 2 / 4 / 8 replicas (1 rank per group at 8)
    Config("w8_1d", 8, 8, what="1D: 1 x 8"),
    Config("w8_m2", 8, 4, what="2 x 4, row-wise AdaGrad"),
    Config("w8_m4", 8, 2, what="4 x 2, row-wise AdaGrad"),
    Config("w8_m8", 8, 1, what="8 x 1, row-wise AdaGrad"),
    Config("w8_m2_momentum", 8, 4, "momentum_rowwise_adagrad", 2.0, what="2 x 4, c = 2"),
    Config("w8_m2_momentum_bf16", 8, 4, "momentum_rowwise_adagrad", 2.0, sync_dtype="bf16",
           what="2 x 4, c = 2, bf16 changes on the wire"),
    Config("w8_m2_momentum_int8", 8, 4, "momentum_rowwise_adagrad", 2.0, sync_dtype="int8",
           what="2 x 4, c = 2, int8 changes with error feedback on the wire"),
    Config("w8_m4_momentum", 8, 2, "momentum_rowwise_adagrad", 4.0, what="4 x 2, c = 4"),
    Config("w8_m8_momentum", 8, 1, "momentum_rowwise_adagrad", 8.0, what="8 x 1, c = 8"),
]

# The Adam study (--optimizer rowwise_adam): 1D against 2 / 4 / 8 replicas averaging weights and every
# state (m, v, step) each step or every 8 steps; the gradients mode (1D's arithmetic) as the control.
# No divisor of the state exists for Adam, so there is no momentum-scaled variant.
ADAM_CONFIGS = [
    Config("adam_1d", 4, 4, "rowwise_adam", what="1D: 1 x 4, row-wise Adam"),
    Config("adam_2d_gradients", 4, 2, "rowwise_adam", sync_mode="gradients",
           what="2 x 2, gradients all-reduced every step (= 1D)"),
    Config("adam_m2", 4, 2, "rowwise_adam", what="2 x 2, weights and state averaged every step"),
    Config("adam_m2_sync8", 4, 2, "rowwise_adam", sync_interval=8, what="2 x 2, averaged every 8 steps"),
    Config("adam_w8_m4", 8, 2, "rowwise_adam", what="4 x 2, averaged every step"),
    Config("adam_w8_m4_sync8", 8, 2, "rowwise_adam", sync_interval=8, what="4 x 2, averaged every 8 steps"),
    Config("adam_w8_m8", 8, 1, "rowwise_adam", what="8 x 1, averaged every step"),
    Config("adam_w8_m8_sync8", 8, 1, "rowwise_adam", sync_interval=8, what="8 x 1, averaged every 8 steps"),
]
ADAM_LRS = (0.01, 0.03, 0.1)  # around the 1D optimum of a sweep over 0.001-0.3 (0.03)

# The fp16 study (--table-dtype fp16): every table in fp16 (fp32 state), with the method's optimizer:
# row-wise AdaGrad in 1D, momentum-scaled row-wise AdaGrad (c = M) in 2D, on the Adam study's meshes;
# 1D in fp32 as the reference.
FP16_CONFIGS = [
    Config("fp32_1d", 4, 4, what="1D: 1 x 4, row-wise AdaGrad, fp32 tables"),
    Config("fp16_1d", 4, 4, table_dtype="fp16", what="1D: 1 x 4, row-wise AdaGrad, fp16 tables"),
    *[Config(f"fp16_{name}{'_sync8' * (interval > 1)}", world, world // m, "momentum_rowwise_adagrad", float(m),
             sync_interval=interval, table_dtype="fp16",
             what=f"{m} x {world // m}, c = {m}, averaged every {'step' if interval == 1 else '8 steps'}")
      for name, world, m in (("m2", 4, 2), ("w8_m4", 8, 4), ("w8_m8", 8, 8)) for interval in (1, 8)],
    Config("fp16_w8_m8_fp16sum", 8, 1, "momentum_rowwise_adagrad", 8.0, table_dtype="fp16", fp16_sum=True,
           what="8 x 1, c = 8, every step, the copies' rows summed in fp16 (7 roundings a round)"),
]
FP16_LRS = (0.08, 0.2)  # the AdaGrad study's 1D best (its shared rate) and the next rate of its sweep
STUDIES = {"rowwise_adagrad": (CONFIGS, LRS, ""), "rowwise_adam": (ADAM_CONFIGS, ADAM_LRS, "_adam"),
           "fp16": (FP16_CONFIGS, FP16_LRS, "_fp16")}
"""The study (``--optimizer``, or ``fp16`` with ``--table-dtype fp16``): its configurations, its default
learning rates and its page's / cache's suffix."""


def make_model(seed: int, dataset: str = "movielens", table_dtype: str = "fp32") -> DLRM:
    """The model of ``seed``; ``table_dtype="fp16"``: its tables in fp16, the same draws rounded to nearest."""
    torch.manual_seed(seed)
    if dataset == "synthetic":
        model = DLRM(table_rows=SYNTHETIC_ROWS, embedding_dim=16, num_dense=13, bottom_mlp=[64], top_mlp=[64, 32],
                     lr=0.003)
    else:
        args = OmegaConf.to_container(OmegaConf.load(CONFIG).model.init_args, resolve=True)
        linked = {name: getattr(MovieLensDataModule, name) for name in LINKED_FROM_DATA}  # as the CLI links them
        model = DLRM(**linked, **args)
    if table_dtype != "fp32":
        with torch.random.fork_rng():  # its own draws, overwritten, leave the generator where fp32's is
            sparse = EmbeddingBagCollection([replace(table, dtype=table_dtype) for table in model.sparse.tables])
        sparse.load_state_dict(model.sparse.state_dict())
        model.sparse = sparse
    return model


def load_data(dataset: str = "movielens"):
    if dataset == "synthetic":
        from lightning_twod.datasets.synthetic import SyntheticClicks

        return (SyntheticClicks(SYNTHETIC_ROWS, SYNTHETIC_TRAIN, base_logit=-1.0, split=0),
                SyntheticClicks(SYNTHETIC_ROWS, SYNTHETIC_VAL, base_logit=-1.0, split=1))
    from lightning_twod.datasets.movielens import MovieLens100K, load

    data = load()
    return MovieLens100K("train", data), MovieLens100K("validation", data)


def metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    logloss = float(F.binary_cross_entropy_with_logits(logits, labels))
    p = float(labels.mean())
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    return {"auc": float(binary_auc(logits, labels)), "ne": logloss / entropy, "logloss": logloss}


def planted_reference(val) -> dict[str, float]:
    """Validation metrics of the planted model's own scores: the best a model can reach."""
    labels = torch.cat([val.collate(list(range(i, min(i + 4096, len(val)))))["label"]
                        for i in range(0, len(val), 4096)])
    return metrics(val.planted_logits(torch.arange(len(val))), labels)


def loss_fn(model: DLRM, batch: dict) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch), batch["label"])


@torch.no_grad()
def evaluate(model: DLRM, dataset, batch: int = 4096) -> dict[str, float]:
    model.eval()
    batches = [dataset.collate(list(range(i, min(i + batch, len(dataset))))) for i in range(0, len(dataset), batch)]
    logits = torch.cat([model(b) for b in batches])
    model.train()
    return metrics(logits, torch.cat([b["label"] for b in batches]))


ITEM_TABLE = "sparse.embedding_bags.t_item_id.weight"  # MovieLens: the long-tailed table
MOVED_BUCKETS = ((1, 10), (11, 100), (101, None))
"""Items by their ratings in the training split (first, last; None: no bound), for ``item_rows_moved``."""


def bucket_name(first: int, last: int | None) -> str:
    return f"{first}+" if last is None else f"{first}-{last}"


def item_rows_moved(table: torch.Tensor, initial: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
    """The mean L2 distance the item table's rows moved from their initialization, by ``MOVED_BUCKETS``
    of ``counts`` (each item's ratings in the training split): how far 2D's rarely read rows train."""
    distance = (table.float() - initial.float()).norm(dim=1)
    moved = {}
    for first, last in MOVED_BUCKETS:
        rows = (counts >= first) & (counts <= (last if last is not None else counts.max()))
        moved[bucket_name(first, last)] = float(distance[rows].mean()) if rows.any() else float("nan")
    return moved


def train_one(config: Config, lr: float, seed: int, epochs: int, train, val, evals_per_epoch: int = 4,
              max_steps: int | None = None, dataset: str = "movielens") -> dict:
    """One run: returns final validation metrics, a validation curve and the training time; on
    MovieLens also ``moved``, ``item_rows_moved`` of the trained item table."""
    model = make_model(seed, dataset, config.table_dtype)
    items = dict(model.named_parameters()).get(ITEM_TABLE) if dataset == "movielens" else None
    initial = None if items is None else items.detach().clone()
    layout = EmulatedLayout(config.world, config.group, config.sync_mode, config.sync_interval,
                            sync_dtype=config.sync_dtype, sync_overlap=config.sync_overlap)
    sparse = SparseOptimizerConfig(config.optimizer, lr, EPS, config.scale)
    emulator = MeshEmulator(model, layout, sparse, loss_fn,
                            dense_optimizer=lambda params: torch.optim.Adam(params, lr=model.lr),
                            sum_dtype="fp16" if config.fp16_sum else "fp32")
    global_batch = LOCAL_BATCH * 4  # the same samples per step for every configuration ...
    local = global_batch // config.world  # ... split over its ranks
    steps_per_epoch = len(train) // global_batch if max_steps is None else max_steps
    curve, losses, start = [], [], time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(1000 * seed + epoch)).tolist()
        for step in range(steps_per_epoch):
            chunk = order[step * global_batch:(step + 1) * global_batch]
            losses.append(emulator.step([train.collate(chunk[r * local:(r + 1) * local]) for r in range(config.world)]))
            done = epoch * steps_per_epoch + step + 1
            if evals_per_epoch and done % max(1, steps_per_epoch // evals_per_epoch) == 0:
                snapshot = _evaluate_synced(emulator, model, val)
                curve.append({"step": done, **snapshot})
    seconds = time.perf_counter() - start
    with emulator.drained():
        final = evaluate(model, val)
        if initial is not None:
            counts = torch.bincount(train.items, minlength=initial.shape[0])
            final["moved"] = item_rows_moved(items.detach(), initial, counts)
    window = max(1, steps_per_epoch // 4)
    return {**final, "curve": curve, "seconds": seconds, "steps": len(losses),
            "first_loss": sum(losses[:window]) / window, "last_loss": sum(losses[-window:]) / window}


def _evaluate_synced(emulator: MeshEmulator, model: DLRM, val) -> dict[str, float]:
    """Validation of the drained copies, as the strategy reports it at the end of fit.

    Mid-run evaluations here are snapshots: the copies and the interval are restored afterwards, so
    the curve does not change the run (the strategy's own validation completes a reduction instead).
    """
    with emulator.drained():
        return evaluate(model, val)


def traffic(config: Config, dataset: str = "movielens") -> dict[str, float]:
    """Predicted KB per step and rank, inside and across shard groups (the planner's traffic model,
    which assumes ids spread evenly over a table's rows: an upper bound for the rows a step touches)."""
    from lightning_twod.planner import Workload, plan_model, predict_traffic, specs_from_configs
    from lightning_twod.planner.inputs import SYNC_BYTES
    from lightning_twod.sparse.wrap import embedding_tables

    if config.world == 1:
        return {"intra_kb": 0.0, "cross_kb": 0.0}
    specs = specs_from_configs(embedding_tables(make_model(0, dataset, config.table_dtype)))
    workload = Workload(batch_size=LOCAL_BATCH * 4 // config.world, optimizer=config.optimizer,
                        sync_mode=config.sync_mode, sync_interval=config.sync_interval,
                        sync_bytes=SYNC_BYTES[config.sync_dtype])
    plan = plan_model(specs, config.world, config.group, workload)
    intra = cross = 0.0
    for module, module_specs in specs.items():
        positions = predict_traffic(module_specs, plan.modules[module], config.group, config.replicas, workload,
                                    steps=16)
        for sent in positions:
            intra += sum(v for k, v in sent.items() if not k.startswith("replica")) / 16 / len(positions)
            cross += sum(v for k, v in sent.items() if k.startswith("replica")) / 16 / len(positions)
    return {"intra_kb": intra / 1e3, "cross_kb": cross / 1e3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--lrs`` and ``--configs`` default to those of the study (``args.study``: the
    ``--optimizer``'s, or ``fp16`` with ``--table-dtype fp16``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["movielens", "synthetic"], default="movielens")
    parser.add_argument("--optimizer", choices=["rowwise_adagrad", "rowwise_adam"], default="rowwise_adagrad",
                        help="the study: its configurations, learning rates and page (default: rowwise_adagrad)")
    parser.add_argument("--table-dtype", choices=["fp32", "fp16"], default="fp32",
                        help="fp16: the study of fp16 tables (row-wise AdaGrad; its own configurations, rates and "
                             "page quality_fp16.md)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (default: the whole split)")
    parser.add_argument("--lrs", type=float, nargs="+", default=None, help="default: the study's (LRS, ADAM_LRS)")
    parser.add_argument("--configs", nargs="+", default=None, help="default: all of the study's")
    parser.add_argument("--paired-seeds", type=int, default=0,
                        help="seeds of the configurations compared with their fp32 blocking twin, and of the twins "
                             "(the paired table; in a study other than rowwise_adagrad's: of every configuration, "
                             "all paired with 1D; default: --seeds)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="default: benchmarks/out/quality_runs[_synthetic][_adam|_fp16].jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--report-only", action="store_true",
                        help="write the page from the cached runs and run nothing (a partial study: the page "
                             "counts the seeds each cell holds)")
    args = parser.parse_args(argv)
    if args.table_dtype == "fp16" and args.optimizer != "rowwise_adagrad":
        parser.error(f"--table-dtype fp16 studies fp16 tables with row-wise AdaGrad, not {args.optimizer}: "
                     "drop --optimizer")
    args.study = "fp16" if args.table_dtype == "fp16" else args.optimizer
    study, lrs, _ = STUDIES[args.study]
    args.lrs = list(lrs) if args.lrs is None else args.lrs
    names = [c.name for c in study]
    args.configs = names if args.configs is None else args.configs
    unknown = sorted(set(args.configs) - set(names))
    if unknown:
        parser.error(f"--configs: not in the {args.study} study: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # many small runs: one thread each is the fastest on a shared machine
    study = STUDIES[args.study][0]
    configs = [c for c in study if c.name in args.configs]
    suffix = ("" if args.dataset == "movielens" else f"_{args.dataset}") + STUDIES[args.study][2]
    args.cache = args.cache or OUT / f"quality_runs{suffix}.jsonl"
    args.cache.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if args.cache.exists():
        for line in args.cache.read_text().splitlines():
            run = json.loads(line)
            done[(run["config"], run["lr"], run["seed"], run["epochs"], run.get("max_steps"))] = run
    train, val = load_data(args.dataset)
    from benchmarks.quality_report import fp32_twins, write_report

    twins = fp32_twins(configs)
    paired = set(twins) | set(twins.values()) if args.study == "rowwise_adagrad" else {c.name for c in configs}
    todo = [(c, lr, s) for c in configs for lr in args.lrs
            for s in range(max(args.seeds, args.paired_seeds) if c.name in paired else args.seeds)
            if (c.name, lr, s, args.epochs, args.steps) not in done]
    print(f"{len(todo)} runs to do, {len(done)} cached in {args.cache}", flush=True)
    if args.report_only:
        todo = []
    for i, (config, lr, seed) in enumerate(todo, 1):
        run = {"config": config.name, "lr": lr, "seed": seed, "epochs": args.epochs, "max_steps": args.steps,
               **train_one(config, lr, seed, args.epochs, train, val, max_steps=args.steps, dataset=args.dataset)}
        done[(config.name, lr, seed, args.epochs, args.steps)] = run
        with args.cache.open("a") as handle:
            handle.write(json.dumps(run) + "\n")
        print(f"[{i}/{len(todo)}] {config.name:<20} lr {lr:<7g} seed {seed}: val AUC {run['auc']:.4f} "
              f"NE {run['ne']:.4f} ({run['seconds']:.0f}s)", flush=True)

    reference = planted_reference(val) if args.dataset == "synthetic" else None
    write_report(configs, args, done, lambda c: traffic(c, args.dataset), CONFIG, out=args.out,
                 suffix=suffix, planted=reference, study=study)


if __name__ == "__main__":
    main()
