"""The DLRM reference model (unsharded; old and new constructor forms; padding samples left out of
loss, metrics and predictions; calibration and CTR logged) and the synthetic Criteo-like data
(generated on the fly: reproducible by seed, independent of batching, planted model learnable)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_twod.core.features import SparseFeatures
from lightning_twod.datasets import SyntheticClicks, SyntheticDataModule
from lightning_twod.metrics import binary_auc
from lightning_twod.models import DLRM


def _batch(rows: dict[str, int], batch: int = 6, num_dense: int = 3) -> dict:
    gen = torch.Generator().manual_seed(0)
    bags = {f: [torch.randint(0, n, (int(k),), generator=gen).tolist()
                for k in torch.randint(0, 3, (batch,), generator=gen)] for f, n in rows.items()}
    return {"dense": torch.randn(batch, num_dense, generator=gen), "sparse": SparseFeatures.from_dict(bags),
            "label": torch.randint(0, 2, (batch,), generator=gen).float()}


def test_dlrm_from_a_mapping_with_mean_pooling():
    rows = {"user": 10, "item": 20, "genres": 5}
    model = DLRM(table_rows=rows, embedding_dim=4, num_dense=3, bottom_mlp=[8], top_mlp=[8], pooling={"genres": "mean"})
    assert [t.name for t in model.sparse.tables] == ["t_user", "t_item", "t_genres"]
    assert [t.pooling for t in model.sparse.tables] == ["sum", "sum", "mean"]
    assert model.state_dict()["sparse.embedding_bags.t_item.weight"].shape == (20, 4)
    assert not any(k.startswith(("val_", "train_", "test_")) for k in model.state_dict()), "metric states"
    batch = _batch(rows)
    logits = model(batch)
    assert logits.shape == (6,)
    # Mean pooling: the genres vector of sample 0 is the mean of its rows (zeros for an empty bag).
    pooled = model.sparse(batch["sparse"])["genres"]
    ids, lengths = batch["sparse"]["genres"].values, batch["sparse"]["genres"].lengths
    weight = model.sparse.embedding_bags["t_genres"].weight
    first = ids[: int(lengths[0])]
    expected = weight[first].mean(0) if first.numel() else torch.zeros(4)
    torch.testing.assert_close(pooled[0], expected)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"]).backward()
    assert model.sparse.embedding_bags["t_user"].weight.grad is not None


def test_dlrm_list_form_keeps_its_names_and_rejects_mismatches():
    model = DLRM(table_rows=[7, 9], embedding_dim=4, bottom_mlp=[4], top_mlp=[4], feature_names=["a", "b"])
    assert model.sparse.feature_names == ["a", "b"]
    assert DLRM(table_rows=[7, 9], embedding_dim=4).sparse.feature_names == ["cat_0", "cat_1"]
    with pytest.raises(ValueError, match="feature_names"):
        DLRM(table_rows=[7, 9], feature_names=["a"])
    with pytest.raises(ValueError, match="pooling names unknown features"):
        DLRM(table_rows={"a": 3}, pooling={"b": "mean"})


@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")  # steps called without a Trainer
def test_padding_samples_are_left_out_of_loss_metrics_and_predictions():
    rows = {"user": 10, "item": 20}
    model = DLRM(table_rows=rows, embedding_dim=4, num_dense=3, bottom_mlp=[8], top_mlp=[8])
    batch = _batch(rows)
    batch["index"] = torch.tensor([4, 5, -1, 7, -1, 9])
    real = batch["index"] >= 0
    logits = model(batch)
    loss = model.training_step(batch, 0)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits[real], batch["label"][real])
    torch.testing.assert_close(loss, expected)
    assert model.train_ne.total.item() == 4, "NE saw the 4 real samples only"
    out = model.predict_step(batch, 0)
    assert out["index"].tolist() == [4, 5, 7, 9] and set(out) == {"index", "logit", "probability", "label"}
    torch.testing.assert_close(out["logit"], logits[real])
    torch.testing.assert_close(out["probability"], torch.sigmoid(logits[real]))
    assert torch.equal(out["label"], batch["label"][real])
    batch["index"] = torch.full((6,), -1)  # a rank's batch of padding only: zero loss, zero gradients
    loss = model.training_step(batch, 0)
    loss.backward()
    assert loss.item() == 0 and all(p.grad is not None and not p.grad.any() for p in model.top.parameters())
    del batch["index"], batch["label"]
    assert set(model.predict_step(batch, 0)) == {"logit", "probability"}


def test_synthetic_samples_depend_only_on_seed_split_and_index():
    rows = [1000, 50, 7]
    data = SyntheticClicks(rows, 500, num_dense=4, seed=3)
    whole = data.collate(list(range(500)))
    part = data.collate([499, 17, 17, 0])
    assert torch.equal(part["dense"][0], whole["dense"][499]) and torch.equal(part["dense"][3], whole["dense"][0])
    assert torch.equal(part["label"], whole["label"][[499, 17, 17, 0]])
    again = SyntheticClicks(rows, 500, num_dense=4, seed=3).collate(list(range(500)))
    assert torch.equal(again["sparse"].values, whole["sparse"].values) and torch.equal(again["label"], whole["label"])
    other_seed = SyntheticClicks(rows, 500, num_dense=4, seed=4).collate(list(range(500)))
    other_split = SyntheticClicks(rows, 500, num_dense=4, seed=3, split=1).collate(list(range(500)))
    assert not torch.equal(other_seed["sparse"].values, whole["sparse"].values)
    assert not torch.equal(other_split["dense"], whole["dense"])
    whole["sparse"].validate({f"cat_{f}": n for f, n in enumerate(rows)})
    assert whole["sparse"].keys == ["cat_0", "cat_1", "cat_2"] and whole["dense"].shape == (500, 4)


def test_synthetic_ids_follow_a_power_law_and_tables_can_be_huge():
    rows = [10_000_000] * 26  # Criteo-like: 26 sparse features; no per-row storage
    data = SyntheticClicks(rows, 4096, num_dense=13, base_logit=-1.5)
    batch = data.collate(list(range(4096)))
    ids = batch["sparse"]["cat_0"].values
    assert ids.max() < 10_000_000 and batch["dense"].shape == (4096, 13)
    assert (ids < 100_000).float().mean() > 0.15, "power law: ids below 1% of the rows get > 15% of samples"
    assert abs(batch["dense"].mean().item()) < 0.05 and abs(batch["dense"].std().item() - 1) < 0.05
    assert 0.15 < batch["label"].mean().item() < 0.35, "base_logit sets a Criteo-like click rate"


def test_planted_model_is_the_ceiling_and_is_learnable(tmp_path):
    rows = [200] * 6
    module = SyntheticDataModule(table_rows=rows, num_train=16384, num_val=4096, num_dense=5, batch_size=256)
    module.setup()
    val = module.val.collate(list(range(len(module.val))))
    oracle = binary_auc(module.val.planted_logits(range(len(module.val))), val["label"]).item()
    assert oracle > 0.75
    pl.seed_everything(0)
    torch.set_num_threads(1)
    model = DLRM(table_rows=rows, embedding_dim=8, num_dense=5, bottom_mlp=[16], top_mlp=[16], lr=0.01)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=tmp_path)
    trainer.fit(model, module)
    auc = float(trainer.callback_metrics["val_auc"])
    assert 0.7 < auc <= oracle + 0.01, (auc, oracle)
    assert float(trainer.callback_metrics["val_ne"]) < 0.95
    assert float(trainer.callback_metrics["val_ctr"]) == pytest.approx(val["label"].mean().item(), abs=1e-6)
    assert 0.8 < float(trainer.callback_metrics["val_calibration"]) < 1.25
    test = trainer.test(model, module, verbose=False)[0]
    labels = module.test.collate(list(range(len(module.test))))["label"]
    assert len(module.test) == 4096 and not torch.equal(labels, val["label"]), "a split of its own"
    assert test["test_ctr"] == pytest.approx(labels.mean().item(), abs=1e-6)
    assert 0.7 < test["test_auc"] and 0.8 < test["test_calibration"] < 1.25
