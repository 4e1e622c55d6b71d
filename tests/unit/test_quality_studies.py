"""The quality benchmark's studies (``--optimizer``) on made-up runs, no training: the Adam study's
configurations, the options that pick a study, its table against 1D paired by seed, and the item
rows' movement by their ratings."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def quality():
    from benchmarks import quality  # a package import: its dataclass needs a module in sys.modules

    return quality


def test_the_adam_study_compares_1d_with_2_4_and_8_replicas_at_intervals_1_and_8(quality):
    study = quality.ADAM_CONFIGS
    assert {c.optimizer for c in study} == {"rowwise_adam"}
    assert {c.scale for c in study} == {1.0}  # no accumulator divisor exists for Adam
    names = [c.name for c in study]
    assert len(set(names)) == len(names) and not set(names) & {c.name for c in quality.CONFIGS}
    assert study[0].replicas == 1 and study[0].name.endswith("1d")  # the report's reference comes first
    weights = {(c.replicas, c.sync_interval) for c in study if c.sync_mode == "weights" and c.replicas > 1}
    assert weights == {(m, k) for m in (2, 4, 8) for k in (1, 8)}
    assert any(c.sync_mode == "gradients" and c.replicas > 1 for c in study)  # the control equal to 1D


def test_optimizer_option_picks_the_study_and_its_rates(quality):
    adagrad = quality.parse_args([])
    assert adagrad.optimizer == "rowwise_adagrad" and adagrad.lrs == list(quality.LRS)
    assert adagrad.configs == [c.name for c in quality.CONFIGS] and not adagrad.report_only
    assert quality.parse_args(["--report-only"]).report_only
    adam = quality.parse_args(["--optimizer", "rowwise_adam"])
    assert adam.lrs == list(quality.ADAM_LRS) and adam.configs == [c.name for c in quality.ADAM_CONFIGS]
    assert quality.STUDIES["rowwise_adam"][2] == "_adam"  # the page quality_adam.md, its own cache
    chosen = quality.parse_args(["--optimizer", "rowwise_adam", "--lrs", "0.5", "--configs", "adam_1d"])
    assert chosen.lrs == [0.5] and chosen.configs == ["adam_1d"]
    with pytest.raises(SystemExit):  # an AdaGrad configuration is not in the Adam study
        quality.parse_args(["--optimizer", "rowwise_adam", "--configs", "w8_m8"])


def test_adam_page_pairs_every_configuration_with_1d_seed_by_seed(quality):
    report = load_benchmark("quality_report")

    def runs(values):
        return [{"seed": s, "auc": a, "ne": 1 - a} for s, a in enumerate(values)]

    by = {"adam_1d": {0.03: runs([0.77, 0.76, 0.78])},
          "adam_m2": {0.03: runs([0.76, 0.76, 0.76])}}
    lines = report._paired_with_reference(["adam_1d", "adam_m2"], by, [0.03, 0.1], 0.03, "adam_1d")
    rows = [line for line in lines if line.startswith("| `")]
    assert len(rows) == 1 and rows[0].startswith("| `adam_m2` |")  # 1D is not compared with itself
    # differences -0.01, 0, -0.02: mean -0.01, standard error 0.01 / sqrt(3); no runs at 0.1
    assert "-0.0100 ± 0.0058 / -" in rows[0] and "+0.0100 ± 0.0058 / -" in rows[0]
    assert "0.03 (shared) / 0.1" in lines[-3] and "over 3 seeds" in lines[1]
    by["adam_w8_m8"] = {0.1: runs([0.7, 0.7]), 0.03: runs([0.7] * 3)}
    by["adam_1d"][0.1] = runs([0.71, 0.72, 0.73])
    rows = [line for line in report._paired_with_reference(["adam_1d", "adam_w8_m8"], by, [0.03, 0.1], 0.03, "adam_1d")
            if line.startswith("| `adam_w8_m8`")]
    assert "-0.0700 ± 0.0058 / -0.0150 ± 0.0050 (2 seeds)" in rows[0]  # a partial cell says how many seeds
    best = report._paired_with_reference(["adam_1d", "adam_w8_m8"], by, [0.03, 0.1], 0.03, "adam_1d",
                                         {"adam_w8_m8": 0.1})
    row = [line for line in best if line.startswith("| `adam_w8_m8`")][0]
    # its own best (0.1, seeds 0 and 1) against 1D at the shared 0.03 (0.77, 0.76)
    assert row.endswith("| 0.1 | -0.0650 ± 0.0050 (2 seeds) | +0.0650 ± 0.0050 (2 seeds) |")
    args = quality.parse_args(["--optimizer", "rowwise_adam"])
    words = report._command(args, [c.name for c in quality.ADAM_CONFIGS], quality.ADAM_CONFIGS)
    assert "--optimizer rowwise_adam" in words and not any(w.startswith("--configs") for w in words)


def test_item_rows_moved_by_ratings_and_as_a_fraction_of_1d(quality):
    report = load_benchmark("quality_report")
    initial = torch.zeros(4, 2)
    table = torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 3.0], [6.0, 8.0]])  # moved 5, 1, 3, 10
    counts = torch.tensor([0, 5, 50, 500])  # an item no rating reads is in no bucket
    assert quality.item_rows_moved(table, initial, counts) == {"1-10": 1.0, "11-100": 3.0, "101+": 10.0}

    def runs(scale):
        return [{"seed": s, "moved": {"1-10": scale * (1 + s), "101+": 2.0 * scale**2}} for s in range(2)]

    by = {"adam_1d": {0.03: runs(1.0)}, "adam_m2": {0.03: runs(0.5)},
          "adam_w8_m8": {0.03: [{"seed": 0, "auc": 0.7}]}}  # a run before the distances were recorded
    lines = report._rows_moved(["adam_1d", "adam_m2", "adam_w8_m8"], by, 0.03, "adam_1d")
    rows = [line for line in lines if line.startswith("| `")]
    assert rows == ["| `adam_1d` | 1.500 ± 0.500 | 2.000 ± 0.000 |", "| `adam_m2` | 0.500x ± 0.000 | 0.250x ± 0.000 |"]
    assert report._rows_moved(["adam_w8_m8"], by, 0.03, "adam_w8_m8") == []
