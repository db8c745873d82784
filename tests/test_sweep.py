"""`hf-lsce sweep`: the choice of b from short runs, its rules, and one end-to-end run on the real checkpoint."""
import json
import math
import statistics

import pytest
import torch

from hf_lsce.calibration import signed_gap_interval
from hf_lsce.diagnosis import accuracy_costs, suggest, verdicts
from hf_lsce.sweep import parse_b_values


def test_b_grid_is_sorted_with_zero_and_bad_grids_are_refused():
    assert parse_b_values("0.2, 0.05,0.1") == [0.0, 0.05, 0.1, 0.2]
    assert parse_b_values([0.1, 0.1]) == [0.0, 0.1]
    for bad, match in (("0.1,high", "numbers separated by commas"), ("0,1", r"\[0, 1\)"), ([-0.1, 0.2], r"\[0, 1\)"),
                       ("0", "at least one b > 0"), ("", "one or more"), ([True, 0.1], "one or more"),
                       ([float("nan")], r"\[0, 1\)")):
        with pytest.raises(ValueError, match=match):
            parse_b_values(bad)


def _cmp(low, high, acc_high=0.01):
    return {"ece": {"low": low, "high": high}, "acc": {"low": acc_high - 0.03, "high": acc_high}}


def test_verdicts_and_suggestion_follow_the_intervals():
    comparisons = {
        "0.05": {"a": _cmp(-0.05, -0.01), "b": _cmp(-0.02, 0.01)},   # one task lower, none higher
        "0.1": {"a": _cmp(-0.08, -0.03), "b": _cmp(-0.01, 0.02)},    # also better
        "0.2": {"a": _cmp(-0.09, -0.04), "b": _cmp(0.01, 0.05)},     # one lower, one higher
        "0.3": {"a": _cmp(0.02, 0.06), "b": _cmp(-0.01, 0.01)},      # worse
        "0.4": {"a": _cmp(-0.01, 0.01), "b": _cmp(-0.02, 0.03)},     # nothing resolvable
    }
    v = verdicts(comparisons)
    assert v == {"0.05": "better", "0.1": "better", "0.2": "mixed", "0.3": "worse", "0.4": "no resolvable change"}
    pooled = {"0": 0.2, "0.05": 0.15, "0.1": 0.17, "0.2": 0.05, "0.3": 0.3, "0.4": 0.01}
    assert suggest(pooled, v) == 0.05  # the lowest pooled ECE among the better ones, not the mixed 0.2 or 0.4
    assert suggest(pooled, {k: "no resolvable change" for k in v}) == 0.0
    comparisons["0.05"]["b"] = _cmp(-0.02, 0.01, acc_high=-0.002)  # 0.05 now costs accuracy on task b
    costs = accuracy_costs(comparisons)
    assert costs == {"0.05": ["b"], "0.1": [], "0.2": [], "0.3": [], "0.4": []}
    assert suggest(pooled, v, costs) == 0.1 and suggest(pooled, v) == 0.05


def test_signed_gap_interval_is_the_normal_interval_of_confidence_minus_correctness():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(200, 4, generator=g) * 2, -1)
    labels = torch.randint(0, 4, (200,), generator=g)
    conf, pred = probs.max(-1)
    d = [float(c) - float(p == y) for c, p, y in zip(conf, pred, labels)]
    half = statistics.NormalDist().inv_cdf(0.975) * statistics.stdev(d) / math.sqrt(len(d))
    lo, hi = signed_gap_interval(probs, labels)
    assert lo == pytest.approx(statistics.fmean(d) - half, abs=1e-12)
    assert hi == pytest.approx(statistics.fmean(d) + half, abs=1e-12)
    with pytest.raises(ValueError, match="level"):
        signed_gap_interval(probs, labels, level=1.5)


def test_sweep_tiny_end_to_end_on_the_real_checkpoint(tmp_path, capsys):
    from hf_lsce.checkpoints import CHECKPOINTS, is_installed
    from hf_lsce.cli import main
    from hf_lsce.data import installed_data_root
    from hf_lsce.patching import ENGAGEMENT

    if not is_installed("smollm2-135m-instruct") or installed_data_root() is None:
        pytest.skip(f"needs the real checkpoint and data: {CHECKPOINTS['smollm2-135m-instruct'].install}")
    assert main(["sweep", "--b", "0.1,high"]) == 2
    assert "numbers separated by commas" in capsys.readouterr().err
    out = tmp_path / "sweep"
    ENGAGEMENT.seen.clear()
    assert main(["sweep", "--tiny", "--b", "0.1", "--eval-tasks", "arc_easy,mmlu", "--output-dir", str(out),
                 "--json", str(tmp_path / "copy.json")]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((out / "sweep.json").read_text())
    assert rep == json.loads((tmp_path / "copy.json").read_text())
    assert rep["b_values"] == [0.0, 0.1] and ENGAGEMENT.seen >= {0.0, 0.1}  # both runs trained through the op
    for key in ("0", "0.1"):
        rows = rep["results"][key]
        assert set(rows) == {"arc_easy", "mmlu"} and all(r["n"] == 8 for r in rows.values())
        for r in rows.values():
            assert r["signed_gap_lo"] <= r["signed_gap"] <= r["signed_gap_hi"]
        n = sum(r["n"] for r in rows.values())
        assert rep["pooled"][key]["ece"] == pytest.approx(sum(r["ece"] * r["n"] for r in rows.values()) / n)
    for task, c in rep["versus_b0"]["0.1"].items():  # the bootstrap's point values are the scored runs' own
        assert c["ece"]["a"] == pytest.approx(rep["results"]["0"][task]["ece"], abs=1e-6)
        assert c["ece"]["b"] == pytest.approx(rep["results"]["0.1"][task]["ece"], abs=1e-6)
        assert c["signed_gap"]["diff"] == pytest.approx(rep["results"]["0.1"][task]["signed_gap"]
                                                        - rep["results"]["0"][task]["signed_gap"], abs=1e-6)
        assert c["ece"]["low"] <= c["ece"]["diff"] <= c["ece"]["high"]
    assert rep["verdict"]["0.1"] == verdicts(rep["versus_b0"])["0.1"]
    for run in rep["runs"].values():  # each run's training record: its losses and the callback's signed gap
        assert run["train_loss"] and run["seconds"] > 0
        assert run["history"] and all("eval_calib/arc_easy_signed_gap" in h for h in run["history"])
    tk = rep["tokens"]  # the next-token level on the held-out instructions, and the b = 0 run's prediction
    assert set(tk) == {"0", "0.1"} and tk["0"]["n"] == tk["0.1"]["n"] > 0
    for t in tk.values():
        assert t["signed_gap"] == pytest.approx(t["mean_confidence"] - t["accuracy"], abs=1e-9)
    g0, g1 = abs(tk["0"]["signed_gap"]), abs(tk["0"]["predicted_gap"]["0.1"])
    assert tk["0"]["prediction"]["0.1"] == ("helps" if g1 < g0 - 0.01 else "hurts" if g1 > g0 + 0.01 else
                                            "little-effect") and "prediction" not in tk["0.1"]
    assert "next-token signed gap on" in printed
    assert rep["accuracy_cost"] == accuracy_costs(rep["versus_b0"])
    assert f"suggested b = {rep['suggested_b']:g}" in printed and (out / "sweep.png").exists()
    assert main(["sweep", "--tiny", "--output-dir", str(out)]) == 2  # not replaced without --overwrite
    assert "--overwrite" in capsys.readouterr().err
