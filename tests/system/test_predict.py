"""``test`` and ``predict`` on a 2x2 mesh (4 gloo processes posing as torchrun ranks): every sample
of the (SYNTHETIC) test split and of a tiny Criteo-format file that the test writes is scored
exactly once, the predictions land in one file sorted by index (or one file per rank), equal the
unsharded model's, and the test metrics equal the single-process metrics of the whole split. Then
``python -m lightning_twod test`` and ``predict`` on every example config (subprocesses)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod import TwoDSparseStrategy
from lightning_twod.datasets import CriteoDataModule, SyntheticDataModule
from lightning_twod.metrics import AUC, CTR, Calibration, NormalizedEntropy
from lightning_twod.models import DLRM
from lightning_twod.strategies.callbacks import PredictionWriter
from tests.helpers import strategy_cases as C
from tests.helpers.criteo_cases import criteo_lines, write
from tests.helpers.distributed import run_distributed
from tests.helpers.processes import child_env

ROOT = Path(__file__).resolve().parents[2]
ROWS = [50, 30, 20]
NUM_TEST, BATCH = 193, 16  # rank 0 gets 49 samples (4 batches), ranks 1-3 48: each gets one padding sample
CRITEO_LINES, CRITEO_ROWS = 34, [11] * 26  # 2 global batches of 16 lines, then 2: ranks 2, 3 get padding


def make_model() -> DLRM:
    pl.seed_everything(0)
    return DLRM(table_rows=ROWS, embedding_dim=8, num_dense=4, bottom_mlp=[8], top_mlp=[8])


def make_criteo_model() -> DLRM:
    pl.seed_everything(1)
    return DLRM(table_rows=CRITEO_ROWS, embedding_dim=4, num_dense=13, bottom_mlp=[4], top_mlp=[4])


def make_data() -> SyntheticDataModule:
    return SyntheticDataModule(table_rows=ROWS, num_train=64, num_val=64, num_test=NUM_TEST, num_dense=4,
                               batch_size=BATCH)


def _trainer(world: int, callbacks: list) -> pl.Trainer:
    strategy = TwoDSparseStrategy(shard_group_size=2, sharding={"t_cat_0": "row_wise"})
    return pl.Trainer(devices=world, strategy=strategy, callbacks=callbacks, **C.trainer_kwargs(-1))


def _worker(rank: int, world: int, port: int, root: str, criteo: str) -> dict:
    C.as_external_rank(rank, world, port)
    one, per_rank = PredictionWriter(f"{root}/synthetic.csv"), PredictionWriter(f"{root}/synthetic.pt", per_rank=True)
    trainer = _trainer(world, [one, per_rank])
    model, data = make_model(), make_data()
    result = trainer.test(model, data, verbose=False)[0]
    batches = trainer.num_test_batches
    trainer.predict(model, data, return_predictions=False)
    writer = PredictionWriter(f"{root}/criteo.csv")
    criteo = CriteoDataModule(test_path=criteo, table_rows=CRITEO_ROWS, batch_size=4)
    criteo_trainer, criteo_model = _trainer(world, [writer]), make_criteo_model()
    criteo_result = criteo_trainer.test(criteo_model, criteo, verbose=False)[0]
    criteo_trainer.predict(criteo_model, criteo, return_predictions=False)
    return {"test": result, "batches": batches, "criteo_test": criteo_result,
            "written": [str(p) for p in one.written + per_rank.written + writer.written]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    criteo = write(root / "test.txt", criteo_lines(CRITEO_LINES, seed=3))
    return run_distributed(_worker, C.WORLD, C.free_port(), str(root), str(criteo), timeout=420), root


def _read_csv(path: Path) -> dict[str, torch.Tensor]:
    with path.open() as file:
        rows = list(csv.DictReader(file))
    return {k: torch.tensor([float(r[k]) for r in rows], dtype=torch.float64) for k in rows[0]}


def _reference(model: DLRM, batch: dict) -> dict[str, float | torch.Tensor]:
    """The unsharded model's logits and metrics on one batch holding the whole split."""
    with torch.no_grad():
        logits = model.eval()(batch)
    metrics = {}
    for name, metric in (("auc", AUC()), ("ne", NormalizedEntropy()), ("calibration", Calibration())):
        metric.update(logits, batch["label"])
        metrics[name] = float(metric.compute())
    ctr = CTR()
    ctr.update(batch["label"])
    metrics["ctr"] = float(ctr.compute())
    return {"logits": logits, **metrics}


def test_test_metrics_on_2x2_equal_the_single_process_metrics(run):
    results, _ = run
    data = make_data()
    data.setup()
    reference = _reference(make_model(), data.test.collate(list(range(NUM_TEST))))
    assert all(r["batches"] == [4] for r in results)
    for r in results:
        for name in ("auc", "ne", "calibration", "ctr"):
            assert r["test"][f"test_{name}"] == pytest.approx(reference[name], abs=1e-5), name
    assert reference["calibration"] != pytest.approx(1.0, abs=1e-3), "an untrained model is off: the check can fail"


def test_predictions_are_one_file_sorted_by_index_equal_to_the_unsharded_model(run):
    results, root = run
    data = make_data()
    data.setup()
    batch = data.test.collate(list(range(NUM_TEST)))
    reference = _reference(make_model(), batch)
    written = _read_csv(root / "synthetic.csv")
    assert written["index"].tolist() == list(range(NUM_TEST)), "every sample once, in order"
    assert written["label"].tolist() == batch["label"].tolist()
    torch.testing.assert_close(written["logit"], reference["logits"].double(), atol=1e-5, rtol=0)
    torch.testing.assert_close(written["probability"], torch.sigmoid(written["logit"]), atol=1e-6, rtol=0)
    assert str(root / "synthetic.csv") in results[0]["written"]
    assert not any(str(root / "synthetic.csv") in r["written"] for r in results[1:]), "rank 0 writes it"


def test_per_rank_files_hold_each_ranks_own_samples(run):
    results, root = run
    for rank in range(C.WORLD):
        path = root / f"synthetic.rank{rank}.pt"
        assert str(path) in results[rank]["written"]
        part = torch.load(path)
        assert part["index"].tolist() == list(range(rank, NUM_TEST, C.WORLD)), "no padding in the output"
        assert set(part) == {"index", "logit", "probability", "label"}


def test_criteo_file_is_scored_once_under_the_strategy(run):
    results, root = run
    data = CriteoDataModule(test_path=str(root / "test.txt"), table_rows=CRITEO_ROWS, batch_size=CRITEO_LINES)
    batch = next(iter(data.test_dataloader()))
    assert batch["index"].tolist() == list(range(CRITEO_LINES))
    reference = _reference(make_criteo_model(), batch)
    written = _read_csv(root / "criteo.csv")
    assert written["index"].tolist() == list(range(CRITEO_LINES))
    torch.testing.assert_close(written["logit"], reference["logits"].double(), atol=1e-5, rtol=0)
    for r in results:
        assert r["criteo_test"]["test_ctr"] == pytest.approx(reference["ctr"], abs=1e-7)
        assert r["criteo_test"]["test_auc"] == pytest.approx(reference["auc"], abs=1e-5)


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("config", sorted((ROOT / "examples" / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_example_configs_test_and_predict(config, tmp_path):
    common = ["--config", str(config), "--trainer.logger=false", "--trainer.enable_progress_bar=false"]
    test = subprocess.run([sys.executable, "-m", "lightning_twod", "test", *common, "--trainer.limit_test_batches=1"],
                          check=False, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert test.returncode == 0, test.stderr[-6000:]
    assert "test: test_auc" in test.stdout and "test_calibration" in test.stdout
    predict = subprocess.run([sys.executable, "-m", "lightning_twod", "predict", *common,
                              "--trainer.limit_predict_batches=1"],
                             check=False, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert predict.returncode == 0, predict.stderr[-6000:]
    written = _read_csv(tmp_path / "predictions" / f"{config.stem}.csv")  # the config's PredictionWriter
    assert set(written) == {"index", "logit", "probability", "label"}
    assert written["index"].tolist() == sorted(set(written["index"].tolist())) and written["index"].numel() > 0
