"""MovieLens-100K read from the installed recbole==1.2.1 wheel (never imported, never copied): the
features against the raw files, the deterministic split, the configs' table sizes, the popularity
baseline against an independent computation, and a short one-process fit that beats it, whose test
metrics and written predictions cover every test rating once."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from omegaconf import OmegaConf

from lightning_twod.cli.fit import TwoDCLI
from lightning_twod.datasets import movielens
from lightning_twod.datasets.movielens import (
    FEATURES,
    TABLE_ROWS,
    MovieLens100K,
    MovieLensDataModule,
    load,
    locate_files,
    popularity_baseline,
)
from lightning_twod.metrics import binary_auc
from lightning_twod.models import DLRM
from lightning_twod.strategies.callbacks import PredictionWriter

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("movielens*.yaml"))


@pytest.fixture(scope="module")
def data():
    return load()


def _raw(kind: str) -> list[list[str]]:
    """The file's rows, parsed here independently of the loader."""
    lines = locate_files()[kind].read_text(encoding="utf-8").splitlines()
    return [line.split("\t") for line in lines[1:] if line]


def test_files_come_from_the_wheel_without_importing_recbole(data):
    paths = locate_files()
    assert all("recbole" in p.parts and p.parent.name == "ml-100k" for p in paths.values())
    assert "recbole" not in sys.modules, "the loader must not import recbole (its dependencies are not installed)"
    tracked = [d for d in ROOT.iterdir() if not d.name.startswith(".")]  # ./.venv holds the wheel's copy
    copies = [p for d in tracked for p in ([d] if d.is_file() else d.rglob("*")) if p.name.startswith("ml-100k.")]
    assert not copies, "MovieLens files must never be in the repository"
    assert data.user.numel() == len(_raw("inter")) == 100_000


def test_split_is_deterministic_disjoint_and_sized(data):
    sizes = [int((data.split == k).sum()) for k in range(3)]
    assert sizes == [80_000, 10_000, 10_000]
    again = load()
    assert torch.equal(again.split, data.split)
    other = load(split_seed=1)
    assert not torch.equal(other.split, data.split), "split_seed changes the split"
    assert sorted(int((other.split == k).sum()) for k in range(3)) == sorted(sizes)
    pairs = {k: set(zip(data.user[data.split == k].tolist(), data.item[data.split == k].tolist())) for k in range(3)}
    assert not (pairs[0] & pairs[1]) and not (pairs[0] & pairs[2]) and not (pairs[1] & pairs[2])


def test_batch_features_match_the_raw_files(data):
    users = {row[0]: row for row in _raw("user")}
    items = {row[0]: row for row in _raw("item")}
    ratings = _raw("inter")
    dataset = MovieLens100K("validation", data)
    picks = [0, 7, 4242, len(dataset) - 1]
    batch = dataset.collate(picks)
    sparse = batch["sparse"]
    assert sparse.keys == list(FEATURES) and sparse.batch_size == len(picks)
    sparse.validate({f: TABLE_ROWS[f] for f in FEATURES})  # every id inside its table
    genre_vocab = sorted({g for row in items.values() for g in row[3].split()})
    for b, pick in enumerate(picks):
        rating = int(dataset.index[pick])
        user_id, item_id, stars = ratings[rating][0], ratings[rating][1], float(ratings[rating][2])
        assert batch["label"][b].item() == float(stars >= 4)
        assert sparse["user_id"].values[b].item() == int(user_id)
        assert sparse["item_id"].values[b].item() == int(item_id)
        age = int(users[user_id][1])
        assert sparse["age"].values[b].item() == 1 + sum(age >= edge for edge in (18, 25, 35, 45, 50, 56))
        assert batch["dense"][b, 0].item() == pytest.approx(age / 100)
        assert batch["dense"][b, 1].item() == pytest.approx((int(items[item_id][2]) - 1900) / 100)
        lengths = sparse["genres"].lengths
        start = int(lengths[:b].sum())
        got = sparse["genres"].values[start:start + int(lengths[b])].tolist()
        assert got == [genre_vocab.index(g) + 1 for g in items[item_id][3].split()], "multi-hot genres"
    assert 0 <= batch["dense"][:, 2].min() and batch["dense"][:, 2].max() <= 1


def test_configs_match_the_data_and_build_the_model(data):
    assert {c.stem for c in CONFIGS} >= {"movielens_2x2", "movielens_1x4", "movielens_1proc"}
    batch = MovieLens100K("train", data).collate(list(range(32)))
    for config in CONFIGS:  # built as the CLI builds them: table_rows and num_dense linked from the data
        cli = TwoDCLI(["--config", str(config), "--trainer.logger=false"], run=False)
        assert isinstance(cli.model, DLRM) and isinstance(cli.datamodule, MovieLensDataModule), config.name
        assert dict(cli.model.hparams.table_rows) == data.table_rows == MovieLensDataModule.table_rows, config.name
        assert cli.model.hparams.num_dense == batch["dense"].shape[1]
        assert cli.model(batch).shape == (32,)
    strategy = OmegaConf.load(ROOT / "examples" / "configs" / "movielens_2x2.yaml").trainer.strategy
    assert strategy.class_path == "lightning_twod.TwoDSparseStrategy" and strategy.init_args.shard_group_size == 2


def test_popularity_baseline_matches_an_independent_count(data):
    train_counts: dict[int, int] = {}
    for item in data.item[data.split == 0].tolist():
        train_counts[item] = train_counts.get(item, 0) + 1
    val = data.split == 1
    scores = [train_counts.get(i, 0) for i in data.item[val].tolist()]
    labels = data.label[val].long().tolist()
    pos = sorted(s for s, y in zip(scores, labels) if y)
    neg = sorted(s for s, y in zip(scores, labels) if not y)
    # For each positive: negatives strictly below, plus half the ties (two-pointer sweep).
    wins, lo, hi = 0.0, 0, 0
    for s in pos:
        while lo < len(neg) and neg[lo] < s:
            lo += 1
        while hi < len(neg) and neg[hi] <= s:
            hi += 1
        wins += lo + 0.5 * (hi - lo)
    expected = wins / (len(pos) * len(neg))
    baseline = popularity_baseline(data, "validation")
    assert baseline["popularity_auc"] == pytest.approx(expected, abs=1e-6)
    assert 0.55 < baseline["popularity_auc"] < 0.7
    assert baseline["positive_rate_auc"] > baseline["popularity_auc"]


def test_one_epoch_on_one_process_beats_the_popularity_baseline(data, tmp_path):
    torch.set_num_threads(1)
    pl.seed_everything(0)
    module = MovieLensDataModule(batch_size=1024)
    module.data = data
    model = DLRM(table_rows=TABLE_ROWS, num_dense=movielens.NUM_DENSE, pooling={"genres": "mean"}, embedding_dim=16,
                 bottom_mlp=[32], top_mlp=[64, 32], lr=0.003)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=tmp_path)
    trainer.fit(model, module)
    baseline = popularity_baseline(data, "validation")["popularity_auc"]
    auc, ne = float(trainer.callback_metrics["val_auc"]), float(trainer.callback_metrics["val_ne"])
    assert auc > baseline + 0.1, (auc, baseline)
    assert ne < 0.9, ne
    test = trainer.test(model, module, verbose=False)[0]
    assert test["test_auc"] > baseline + 0.1 and test["test_ne"] < 0.9
    labels = data.label[data.split == 2]
    assert test["test_ctr"] == pytest.approx(float(labels.mean()), abs=1e-6), "every test rating counted once"
    assert 0.8 < test["test_calibration"] < 1.25, "a trained model predicts about as many positives as there are"
    assert test["test_calibration"] != pytest.approx(1.0, abs=1e-4)

    writer = PredictionWriter(str(tmp_path / "predictions.csv"))
    predictor = pl.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[writer], enable_progress_bar=False,
                           default_root_dir=tmp_path)
    predictor.predict(model, module, return_predictions=False)
    with (tmp_path / "predictions.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [int(r["index"]) for r in rows] == list(range(10_000))
    assert [float(r["label"]) for r in rows] == labels.tolist()
    scores = torch.tensor([float(r["probability"]) for r in rows])
    assert binary_auc(scores, labels).item() == pytest.approx(test["test_auc"], abs=1e-4), "the tested model's scores"

    # docs/checkpoints.md: the checkpoint loads strictly into a fresh unsharded model.
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    restored = DLRM(**checkpoint["hyper_parameters"])
    restored.load_state_dict(checkpoint["state_dict"], strict=True)
    batch = MovieLens100K("test", data).collate(list(range(64)))
    with torch.no_grad():
        expected = model.eval()(batch)
        torch.testing.assert_close(restored.eval()(batch), expected, rtol=0, atol=0)
        torch.testing.assert_close(DLRM.load_from_checkpoint(path).eval()(batch), expected, rtol=0, atol=0)


def test_missing_wheel_names_the_install_command(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(movielens.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps recbole==1.2.1"):
        locate_files()
