"""The quality benchmark's fp16 study (``--table-dtype fp16``) without training: its configurations, the
option that picks it, its model's fp16 tables, and its page's tables paired by seed (against 1D in fp32,
against 1D in fp16, and the fp16 sum, ``MeshEmulator(sum_dtype="fp16")``, against the mean rounded once)."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.helpers.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def quality():
    from benchmarks import quality  # a package import: its dataclass needs a module in sys.modules

    return quality


def test_the_fp16_study_compares_1d_in_fp32_and_fp16_with_2_4_and_8_replicas_at_intervals_1_and_8(quality):
    study = quality.FP16_CONFIGS
    reference, half_1d, *twod = study
    assert (reference.replicas, reference.table_dtype, reference.optimizer) == (1, "fp32", "rowwise_adagrad")
    assert reference.name.endswith("1d")  # the report's reference comes first
    assert (half_1d.replicas, half_1d.table_dtype, half_1d.optimizer) == (1, "fp16", "rowwise_adagrad")
    assert {c.table_dtype for c in twod} == {"fp16"} and {c.optimizer for c in twod} == {"momentum_rowwise_adagrad"}
    assert all(c.scale == c.replicas for c in twod)  # momentum scaling c = M, as the AdaGrad study uses it
    assert {(c.replicas, c.sync_interval) for c in twod} == {(m, k) for m in (2, 4, 8) for k in (1, 8)}
    adam_meshes = {(c.world, c.group) for c in quality.ADAM_CONFIGS if c.replicas > 1}
    assert {(c.world, c.group) for c in twod} == adam_meshes == {(4, 2), (8, 2), (8, 1)}
    assert all(c.sync_mode == "weights" and c.sync_dtype == "fp32" and not c.sync_overlap for c in study)
    names = [c.name for c in study]
    others = {c.name for c in quality.CONFIGS + quality.ADAM_CONFIGS}
    assert len(set(names)) == len(names) and not set(names) & others
    report = load_benchmark("quality_report")
    assert report.fp16_sum_twins(study) == {"fp16_w8_m8_fp16sum": "fp16_w8_m8"}  # 8 copies: the most roundings


@pytest.mark.parametrize("name, sum_dtype", [("fp16_w8_m8_fp16sum", "fp16"), ("fp16_w8_m8", "fp32")])
def test_the_fp16sum_configuration_has_the_emulator_sum_the_copies_in_fp16(quality, monkeypatch, name, sum_dtype):
    built = []

    class Built(Exception):
        pass

    def emulator(*args, sum_dtype="fp32", **kwargs):
        built.append(sum_dtype)
        raise Built  # the option is all this test reads: no training

    monkeypatch.setattr(quality, "MeshEmulator", emulator)
    config = next(c for c in quality.FP16_CONFIGS if c.name == name)
    with pytest.raises(Built):
        quality.train_one(config, 0.1, seed=0, epochs=1, train=None, val=None)
    assert built == [sum_dtype]


def test_table_dtype_option_picks_the_fp16_study_its_rates_and_page(quality):
    assert quality.parse_args([]).study == "rowwise_adagrad" and quality.parse_args([]).table_dtype == "fp32"
    assert quality.parse_args(["--optimizer", "rowwise_adam"]).study == "rowwise_adam"
    half = quality.parse_args(["--table-dtype", "fp16"])
    assert half.study == "fp16" and half.optimizer == "rowwise_adagrad"
    assert half.lrs == list(quality.FP16_LRS) and half.configs == [c.name for c in quality.FP16_CONFIGS]
    assert quality.STUDIES["fp16"][2] == "_fp16"  # the page quality_fp16.md, its own cache
    assert 0.08 in quality.FP16_LRS  # the AdaGrad study's 1D best, so that its 1D numbers compare
    with pytest.raises(SystemExit):  # the fp16 study trains row-wise AdaGrad
        quality.parse_args(["--table-dtype", "fp16", "--optimizer", "rowwise_adam"])
    with pytest.raises(SystemExit):  # an fp32 configuration of the AdaGrad study is not in it
        quality.parse_args(["--table-dtype", "fp16", "--configs", "w8_m8"])
    with pytest.raises(SystemExit):
        quality.parse_args(["--optimizer", "fp16"])  # a study, not an optimizer
    report = load_benchmark("quality_report")
    words = report._command(half, half.configs, quality.FP16_CONFIGS)
    assert "--table-dtype fp16" in words and not any(w.startswith(("--optimizer", "--configs")) for w in words)
    assert "--table-dtype fp16" not in report._command(quality.parse_args([]), [c.name for c in quality.CONFIGS])


def test_fp16_model_has_the_fp32_models_rows_rounded_and_leaves_the_generator_alone(quality):
    fp32 = quality.make_model(3)
    after_fp32 = torch.rand(4)
    half = quality.make_model(3, table_dtype="fp16")
    assert torch.equal(torch.rand(4), after_fp32)  # the runs' later draws do not depend on the dtype
    for (key, a), (other, b) in zip(fp32.state_dict().items(), half.state_dict().items(), strict=True):
        assert key == other
        if key.startswith("sparse."):
            assert b.dtype == torch.float16 and torch.equal(b, a.half()), key
        else:
            assert torch.equal(a, b), key
    assert [t.dtype for t in half.sparse.tables] == ["fp16"] * len(fp32.sparse.tables)


def test_fp16_page_pairs_2d_with_1d_in_fp32_and_with_1d_in_fp16(quality, tmp_path):
    report = load_benchmark("quality_report")
    args = quality.parse_args(["--table-dtype", "fp16", "--seeds", "2"])
    aucs = {"fp32_1d": (0.78, 0.77), "fp16_1d": (0.77, 0.77), "fp16_w8_m8": (0.76, 0.75),
            "fp16_w8_m8_fp16sum": (0.76, 0.74)}
    runs = {(name, lr, seed, args.epochs, None): {"config": name, "seed": seed, "auc": auc + (lr == 0.2) * 0.001,
                                                   "ne": 1 - auc, "logloss": 0.5, "curve": []}
            for name, values in aucs.items() for lr in args.lrs for seed, auc in enumerate(values)}
    configs = [c for c in quality.FP16_CONFIGS if c.name in aucs]
    page = report.write_report(configs, argparse.Namespace(**vars(args)), runs,
                               lambda c: {"intra_kb": 0.0, "cross_kb": 0.0}, quality.CONFIG, out=tmp_path,
                               suffix="_fp16", study=quality.FP16_CONFIGS)
    text = page.read_text()
    assert page.name == "quality_fp16.md" and text.startswith("# Quality of fp16 tables: 1D vs 2D")
    assert "--table-dtype fp16" in text and "Shared rate** = the best of `fp32_1d` (1D): 0.2" in text
    against_fp32 = text.split("Against `fp32_1d`")[1].split("Against `fp16_1d`")[0]
    against_fp16, against_mean = text.split("Against `fp16_1d`")[1].split("Against `fp16_w8_m8`")
    # fp16 1D against fp32 1D: differences 0.77 - 0.78 and 0; 8 replicas: -0.02 and -0.02
    assert "| `fp16_1d` | -0.0050 ± 0.0050 / -0.0050 ± 0.0050 |" in against_fp32
    assert "| `fp16_w8_m8` | -0.0200 ± 0.0000 / -0.0200 ± 0.0000 |" in against_fp32
    assert "at lr 0.08 / 0.2 (shared) |" in against_fp32 and "at lr 0.08 / 0.2 (`fp16_1d`'s best) |" in against_fp16
    rows = [line for line in against_fp16.splitlines() if line.startswith("| `")]
    # 8 replicas against 1D in fp16: -0.01 and -0.02; 1D is not compared with itself, nor fp32 1D with it
    assert len(rows) == 2 and rows[0].startswith("| `fp16_w8_m8` | -0.0150 ± 0.0050 / -0.0150 ± 0.0050 |")
    # the fp16 sum against the mean rounded once: 0 and -0.01
    assert against_mean.startswith(" (its rows' mean rounded once) at the same rate")
    rows = [line for line in against_mean.splitlines() if line.startswith("| `")]
    assert rows == ["| `fp16_w8_m8_fp16sum` | -0.0050 ± 0.0050 / -0.0050 ± 0.0050 | "
                    "+0.0050 ± 0.0050 / +0.0050 ± 0.0050 |"]
