"""The GPU scripts' CPU smoke modes run (the code paths, not the figures), and the staging of large files to the
device machine (tools/gpu/gpu_stage.py) survives its own checks."""
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


def test_staging_splits_checks_and_joins(tmp_path):
    sys.path.insert(0, str(ROOT / "tools" / "gpu"))
    import gpu_stage

    data = os.urandom(3 * 1024 * 1024 + 123)
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    gpu_stage.split([str(src)], str(tmp_path / "stage"), part_mb=1)
    parts = sorted((tmp_path / "stage").glob("model.gguf.part*"))
    assert len(parts) == 4
    for p in parts[:-1]:
        gpu_stage.put(str(p), str(tmp_path / "dev"))
    with pytest.raises(SystemExit):  # a part missing: the machine went cold
        gpu_stage.join("model.gguf", str(tmp_path / "dev"))
    gpu_stage.put(str(parts[-1]), str(tmp_path / "dev"))
    assert Path(gpu_stage.join("model.gguf", str(tmp_path / "dev"))).read_bytes() == data
    parts[0].write_bytes(b"broken")
    with pytest.raises(SystemExit, match="checksum"):
        gpu_stage.put(str(parts[0]), str(tmp_path / "dev2"))


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


@pytest.mark.parametrize("average_across_devices", [True, False])
def test_multi_gpu_judge_recovers_the_one_gpu_loss_under_both_token_averagings(average_across_devices):
    """tools/frameworks_gpu.py's several-GPU check: from each rank's loss as the Trainer returns it (LLaMA-Factory
    keeps ``average_tokens_across_devices``: world x its token sum over the global count; Axolotl turns it off: its own
    token mean) it rebuilds the global token mean of the same tokens, computed here directly in fp64."""
    sys.path.insert(0, str(ROOT / "tools"))
    import frameworks_gpu

    g = torch.Generator().manual_seed(0)
    world, steps = 4, 3
    counts = [[int(torch.randint(50, 400, (), generator=g)) for _ in range(steps)] for _ in range(world)]
    tokens = [[torch.rand(n, generator=g, dtype=torch.float64) * 12 for n in rank] for rank in counts]
    total = [sum(counts[r][k] for r in range(world)) for k in range(steps)]
    one_gpu = [float(torch.cat([tokens[r][k] for r in range(world)]).mean()) for k in range(steps)]
    if average_across_devices:
        rank_losses = [[float(tokens[r][k].sum()) / total[k] * world for k in range(steps)] for r in range(world)]
    else:
        rank_losses = [[float(tokens[r][k].mean()) for k in range(steps)] for r in range(world)]
    multi = dict(variant="lsce", engine="zero3", gpus=world, rank_losses=rank_losses, rank_label_tokens=counts,
                 losses=[sum(x) / world for x in zip(*rank_losses)], lm_head_logit_calls=0, confirmed=True,
                 ranks_confirmed=[True] * world, average_tokens_across_devices=average_across_devices)
    rows = [dict(variant="lsce", losses=one_gpu, lm_head_logit_calls=0, confirmed=True), multi]
    frameworks_gpu.judge_multi(rows)
    assert max(rows[1]["rel_error_vs_1gpu"]) < 1e-12 and rows[1]["passed"]
    # the other convention's reading of the same ranks is not the global mean: the check can fail
    wrong = dict(multi, average_tokens_across_devices=not average_across_devices)
    rows = [rows[0], wrong]
    frameworks_gpu.judge_multi(rows)
    assert rows[1]["rel_error_vs_1gpu"][0] > 1e-4 and not rows[1]["passed"]


def test_framework_tables_read_stalls_and_out_of_memory_as_the_docs_say():
    """tools/frameworks_gpu.py's tables, which docs/frameworks.md quotes: ``median_tps`` is the median of the timed
    steps' tokens/s (one stalled step leaves it where the other steps put it, where the total over the time falls), and
    ``largest_table`` names an out-of-memory size and the largest size each variant fit."""
    sys.path.insert(0, str(ROOT / "tools"))
    import frameworks_gpu

    warm = frameworks_gpu.WARMUP
    secs = [9.0] * warm + [0.5, 0.4, 5.0, 0.5, 0.25]  # one stall of 5 s among the timed steps
    toks = [1000] * warm + [1000, 1000, 1000, 1000, 500]
    row = {"step_seconds": secs, "step_tokens": toks}
    assert frameworks_gpu.median_tps(row) == pytest.approx(2000.0)  # 2000, 2500, 200, 2000, 2000
    assert sum(toks[warm:]) / sum(secs[warm:]) < 700  # what the stall does to the total-over-time figure

    def fit(variant, m, tps):
        return {"variant": variant, "micro_batch": m, "tokens_per_gpu": m * 8192, "tokens_per_s": tps,
                "peak_gib": 50.0, "timed_steps": 2, "lm_head_logit_calls": 0, "confirmed": True}

    oom = {"variant": "stock", "micro_batch": 16, "tokens_per_gpu": 16 * 8192, "error": ["OutOfMemoryError"],
           "out_of_memory": True}
    expandable = dict(fit("lsce", 32, 103.0), alloc_conf="expandable_segments:True")
    text = frameworks_gpu.largest_table([fit("stock", 8, 100.0), oom, fit("lsce", 8, 101.0), fit("lsce", 16, 102.0),
                                         expandable])
    assert "| stock (LabelSmoother) | 16 (131,072) | no: out of memory |" in text
    assert "| hf_lsce, expandable_segments:True | 32 (262,144) | yes | 103 |" in text
    assert text.splitlines()[-1] == ("Largest that fit: stock (LabelSmoother) 65,536 tokens per GPU at 100 tok/s; "
                                     "hf_lsce 131,072 tokens per GPU at 102 tok/s; "
                                     "hf_lsce, expandable_segments:True 262,144 tokens per GPU at 103 tok/s")
    # LLaMA-Factory's stock is its own Trainer's smoothing, not the probe's LabelSmoother
    lf = frameworks_gpu.largest_table([dict(fit("stock", 8, 100.0), framework="llamafactory")])
    assert "| stock (its smoothing) | 8 (65,536) | yes |" in lf


def test_framework_table_takes_the_median_of_repeated_runs(tmp_path):
    """``run --repeats``: each variant's runs become one row of the table (``aggregate``): the median of their
    tokens/s, their spread, a failed run counted apart and not averaged in, every check required; ``plot`` draws
    the same rows."""
    sys.path.insert(0, str(ROOT / "tools"))
    import frameworks_gpu

    warm = frameworks_gpu.WARMUP

    def run(variant, step_s, confirmed=True):
        return {"model": "m", "mode": "lora", "b": 0.1, "variant": variant, "losses": [2.0, 1.9],
                "step_seconds": [1.0] * warm + [step_s] * 4, "step_tokens": [100] * (warm + 4),
                "tokens_per_s": 100 / step_s, "peak_gib": 1.0, "lm_head_logit_calls": 0, "confirmed": confirmed}

    ours = [run("lsce", 0.5), run("lsce", 0.25), run("lsce", 1.0), dict(run("lsce", 0.1), error=["OOM"])]
    row = frameworks_gpu.aggregate(ours)
    assert row["median_tps"] == pytest.approx(200.0) and row["tokens_per_s"] == pytest.approx(200.0)
    assert (row["runs"], row["failed_runs"]) == (3, 1) and row["spread"] == pytest.approx((400 - 100) / 200)
    assert not frameworks_gpu.aggregate([run("lsce", 0.5), run("lsce", 0.5, confirmed=False)])["confirmed"]
    stock = [dict(run("stock", 0.5), lm_head_logit_calls=12), dict(run("stock", 1.0), lm_head_logit_calls=12)]
    line = frameworks_gpu.table(ours + stock).splitlines()[-1]
    # hf_lsce 200 tok/s against stock's median of 200 and 100: 150
    assert "| 1.33 x |" in line and "| 1.33, - |" in line and line.endswith("| True | 2, 150% (1 failed) |")
    # table --ours lsce_liger: that variant (LLaMA-Factory's route with Liger's other kernels) in hf_lsce's columns
    both = ours + stock + [dict(run("lsce_liger", 0.125), losses=[2.00002, 1.9])]
    line = frameworks_gpu.table(both, ours="lsce_liger").splitlines()[-1]
    assert "| 800, 1.0 |" in line and "| 5.33 x |" in line and "| 1.0e-05 (ok) |" in line
    v = {"torch": "2.13.0", "triton": "3.7.1"}
    text = frameworks_gpu.table([dict(r, versions=v) for r in ours] + [dict(stock[0], versions=dict(v, torch="2.11.0"))])
    assert text.splitlines()[-2:] == ["Versions (4 runs): torch 2.13.0, triton 3.7.1",
                                      "Versions (1 runs): torch 2.11.0, triton 3.7.1"]
    frameworks_gpu.plot(ours + stock, str(tmp_path / "grid.png"), "t")
    assert (tmp_path / "grid.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the picture draws every variant the rows hold, lsce_liger too, against stock's median
    keys, series = frameworks_gpu.plot_series(both)
    assert keys == [("m", "lora", 0.1)] and list(series) == ["stock", "lsce", "lsce_liger"]
    assert series["lsce_liger"][1] == [pytest.approx(800 / 150)] and series["lsce"][1] == [pytest.approx(200 / 150)]


def test_framework_probe_profiles_three_steps_and_can_turn_cudnn_attention_off(tmp_path, monkeypatch):
    """tools/frameworks/probe.py's ``run --profile`` and ``--no-cudnn-attention`` (docs/frameworks.md quotes both): on
    a Trainer it probes, the profile covers exactly three optimizer steps, and cuDNN's attention is off for that run
    and on again for the rest of the suite (the flag is process-wide)."""
    from transformers import Trainer, TrainingArguments

    from tiny_models import tiny_model

    sys.path.insert(0, str(ROOT / "tools" / "frameworks"))
    import probe

    out, prof = tmp_path / "probe.json", tmp_path / "run.prof.txt"
    monkeypatch.setenv("LSCE_PROBE_OUT", str(out))
    monkeypatch.setenv("LSCE_PROBE_PROFILE", str(prof))
    monkeypatch.setenv("LSCE_PROBE_NO_CUDNN_ATTENTION", "1")
    was = torch.backends.cuda.cudnn_sdp_enabled()
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(24)]
    for r in rows:
        r["labels"] = r["input_ids"].clone()
    args = TrainingArguments(str(tmp_path / "o"), max_steps=10, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(tiny_model(vocab_size=64), args, train_dataset=rows)
    try:
        probe.install(trainer)
        trainer.train()
        record = json.loads(out.read_text())
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)
    assert record["cudnn_attention"] is False and len(record["losses"]) == 10
    assert record["versions"]["torch"] == torch.__version__  # (what ran is in every record)
    text = prof.read_text()
    assert text.startswith("3 steps: wall ")
    step_line = next(x for x in text.splitlines() if "Optimizer.step#AdamW.step" in x)
    assert step_line.split()[-1] == "3"  # the operator table's last column: its number of calls
    # ``largest --profile``: another span of steps (here step 2 alone), and a bad span refused by name
    monkeypatch.setenv("LSCE_PROBE_PROFILE_STEPS", "1,2")
    trainer = Trainer(tiny_model(vocab_size=64), args, train_dataset=rows)
    probe.install(trainer)
    trainer.train()
    text = prof.read_text()
    assert text.startswith("1 steps: wall ")
    assert next(x for x in text.splitlines() if "Optimizer.step#AdamW.step" in x).split()[-1] == "1"
    monkeypatch.setenv("LSCE_PROBE_PROFILE_STEPS", "2,2")
    with pytest.raises(ValueError, match="LSCE_PROBE_PROFILE_STEPS"):
        probe.profile_steps()
