"""The GPU scripts' CPU smoke modes run (the code paths, not the figures)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def _run(args, tmp_path, timeout=600, env_extra=None):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **(env_extra or {}))
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_realistic_generator_follows_its_parameters():
    """A stronger shared prior or a higher peak makes more tiles negligible; sorting by mean logit never less."""
    sys.path.insert(0, str(BENCH))
    from real_inputs import realistic_batch, softmax_statistics

    def skip(**p):
        h, w, y = realistic_batch(256, 32, 8192, dtype=torch.float32, **p)
        st = softmax_statistics(h, w, y, tiles=[(64, 128)], eps=[2.0 ** -12])["skippable_tiles"]["64x128"]
        return st["natural"]["2^-12"], st["sorted"]["2^-12"]

    weak, strong = skip(prior=2.0, peak=12, noise=0.5), skip(prior=3.0, peak=14, noise=0.3)
    assert strong[0] > weak[0] > 0 and strong[1] > strong[0] and weak[1] > weak[0]


def test_kernel_benchmark_smoke(tmp_path):
    """The op benchmark's CPU code path: every configuration's rows (trainable and frozen heads), the errors against
    fp64 within bf16's, no dW for a frozen head, and a table with the ratios to torch.compile."""
    out = _run([str(BENCH / "bench_linear_cross_entropy.py"), "--smoke", "--out-dir", str(tmp_path)], tmp_path)
    rows = json.loads((tmp_path / "bench_linear_cross_entropy.json").read_text())["rows"]
    ours = [r for r in rows if r["method"] == "hf_lsce"]
    assert {(r["head"], r["b"]) for r in ours} == {(h, b) for h in ("trainable", "frozen") for b in (0.1, 0.0)}
    assert all(r["dh_err"] < 1e-2 for r in ours)
    assert all((r["dw_err"] is None) == (r["head"] == "frozen") for r in ours)
    assert "| hf_lsce (low) |" in out and "/ torch.compile" in out


def test_trainer_benchmark_smoke_proves_engagement(tmp_path):
    out = _run([str(BENCH / "bench_trainer.py"), "--smoke", "--repeats", "2", "--out-dir", str(tmp_path)], tmp_path)
    rows = json.loads((tmp_path / "bench_trainer.json").read_text())["rows"]
    ours = [r for r in rows if r["method"] == "hf_lsce"]
    assert ours and all(r["engaged"] and r["lm_head_calls"] == 0 for r in ours)
    # the first batch's patched loss is the model's own smoothed loss (fp32 on CPU)
    assert all(abs(r["first_batch_patched_loss"] - r["first_batch_own_loss"]) < 1e-5 * r["first_batch_own_loss"]
               for r in ours)
    assert all(r["lm_head_calls"] > 0 for r in rows if r["method"] == "hf")
    # --repeats: one row per method, the lower median of its runs, each run's tokens/s kept and shown as a range
    assert len({(r["method"], r["label_smoothing"]) for r in rows}) == len(rows)
    for r in rows:
        assert len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s"] == min(r["tokens_per_s_runs"])
    assert "2 runs)" in out


def test_table1_and_ats_smoke(tmp_path, shared_data):
    env = {"HF_LSCE_SHARED_DATA": shared_data}
    _run([str(BENCH / "table1.py"), "--smoke", "--out-dir", str(tmp_path)], tmp_path, env_extra=env)
    table = json.loads((tmp_path / "table1.json").read_text())
    assert {(r["dataset"], r["b"]) for r in table["runs"]} == {("base", None), ("alpaca", 0.0), ("alpaca", 0.1)}
    assert "vs_b0" in table["runs"][-1] and (tmp_path / "table1.md").exists()
    _run([str(BENCH / "table1.py"), "--smoke", "--ats", "--out-dir", str(tmp_path)], tmp_path, env_extra=env)
    ats = json.loads((tmp_path / "ats_real.json").read_text())
    assert set(ats["tasks"]) >= {"mmlu", "truthfulqa_mc1"}
    assert set(ats["tasks"]["mmlu"]) == {"none", "ATS", "temperature"}


def test_triviaqa_answer_extraction_and_matching():
    """Free-form answers: the first non-empty line, a leading "The answer is:" dropped, aliases matched as
    whole words after the usual normalisation (an empty answer is never correct)."""
    sys.path.insert(0, str(BENCH))
    import table1

    assert table1.extract_answer("\n The answer is: Mount Kilimanjaro.\n\nQuestion: ...") == "Mount Kilimanjaro."
    assert table1.extract_answer("\n\n") == ""
    assert table1.trivia_correct("Mount Kilimanjaro.", {"kilimanjaro"})
    assert table1.trivia_correct("The Exile", {"exile"})
    assert not table1.trivia_correct("Kilimanjaro", {"mount kilimanjaro"})
    assert not table1.trivia_correct("Exiled", {"exile"})
    assert not table1.trivia_correct("", {""})


def test_table1_plan_covers_every_lr_and_seed_once():
    sys.path.insert(0, str(BENCH))
    import table1

    models, seeds, lrs = ["g", "s"], [0, 1, 2], [2e-5, 5e-6, 5e-5, 2e-4]
    runs = table1.plan(models, ["alpaca", "qa"], seeds, lrs, [0.0, 0.1], [0.2])
    assert len(runs) == len(set(runs))
    # the paper's four learning rates, three seeds each, b = 0 and 0.1, on the first instruction set
    assert {(m, lr, s, b) for m, d, b, lr, s in runs if d == "alpaca" and b in (0.0, 0.1)} == {
        (m, lr, s, b) for m in models for lr in lrs for s in seeds for b in (0.0, 0.1)}
    order = [(lr, s) for m, d, b, lr, s in runs if d == "alpaca" and b in (0.0, 0.1)]
    # priority: every learning rate reaches seed 1 before any other than the first reaches seed 2
    assert order.index((5e-6, 1)) < order.index((2e-4, 1)) < order.index((5e-6, 2))


def test_table1_answer_prior_table():
    """The answer prior of a fixed-answer task from stored option probabilities: the most given answer, its share of
    the items, the share of items whose gold answer it is, accuracy; and the report's row for a paired seed."""
    sys.path.insert(0, str(BENCH))
    import table1

    labels = torch.tensor([1, 1, 1, 0, 0])  # BoolQ: " no" = 0, " yes" = 1
    leans_yes = torch.tensor([[0.2, 0.8], [0.3, 0.7], [0.4, 0.6], [0.1, 0.9], [0.6, 0.4]])
    prior = table1.answer_prior(leans_yes, labels, table1.ANSWER_SETS["boolq"])
    assert prior.pop("answer") == "yes"  # picked: yes, yes, yes, yes, no; gold: yes, yes, yes, no, no
    assert prior == pytest.approx({"share": 0.8, "gold_share": 0.6, "acc": 0.8})
    leans_no = 1 - leans_yes
    runs = [{"model": "/x/m.gguf", "dataset": "alpaca", "b": b, "lr": 2e-5, "seed": 0} for b in (0.0, 0.1)]
    probs = {"/x/m.gguf|alpaca|0.0|2e-05|0": {"boolq": (leans_yes, labels)},
             "/x/m.gguf|alpaca|0.1|2e-05|0": {"boolq": (leans_no, labels)}}
    rows = table1.prior_table(runs, probs)
    assert rows[-1] == "| m.gguf | alpaca | 2e-05 | 1 | yes 0.80 -> no 0.80 (gold: no 0.40, yes 0.60) |"
    assert table1.prior_table(runs, {}) == []