"""Calibration metrics against torchmetrics and hand computations; tasks on real rows; scoring and the
callback end to end with a tiny random Llama."""
import copy
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import multiclass_calibration_error

from hf_lsce.calibration import (Task, MultipleChoiceItem, adaptive_calibration_error, brier_score,
                                 calibration_metrics, evaluate_metric_path, expected_calibration_error,
                                 load_task, maximum_calibration_error, negative_log_likelihood, parse_task_names,
                                 reliability_data, reliability_diagram, rms_calibration_error, score_task,
                                 static_calibration_error)


def _random_probs(n, k, seed, temp=2.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, k, generator=g, dtype=torch.float64) * temp, -1)
    return p, torch.randint(0, k, (n,), generator=g)


# ------------------------------------------------------------------------------------- metrics
@pytest.mark.parametrize("n,k,bins,seed", [(1, 3, 15, 0), (7, 2, 10, 1), (500, 4, 15, 2), (2000, 10, 7, 3)])
def test_top_label_metrics_match_torchmetrics(n, k, bins, seed):
    p, y = _random_probs(n, k, seed)
    r = calibration_metrics(p, y, n_bins=bins)
    for norm, ours in (("l1", r.ece), ("l2", r.rms), ("max", r.mce)):
        tm = float(multiclass_calibration_error(p, y, num_classes=k, n_bins=bins, norm=norm))
        assert ours == pytest.approx(tm, abs=1e-6), norm


def test_exact_ones_follow_torchmetrics_with_own_bin():
    # a peaked (bf16-like) model: many confidences are exactly 1.0
    p, y = _random_probs(300, 5, 4, temp=30.0)
    p = torch.where(p > 0.999, torch.ones_like(p), torch.where(p.max(1, keepdim=True).values > 0.999,
                                                                torch.zeros_like(p), p))
    assert (p.max(1).values == 1).sum() > 20
    conf, correct = p.max(1).values, (p.argmax(1) == y).double()
    for norm, fn in (("l1", expected_calibration_error), ("l2", rms_calibration_error),
                     ("max", maximum_calibration_error)):
        tm = float(multiclass_calibration_error(p, y, num_classes=5, n_bins=10, norm=norm))
        assert fn(conf, correct, 10, ones_in_last_bin=False) == pytest.approx(tm, abs=1e-6)


def test_hand_computed_case_and_bin_conventions():
    # 5 bins [0,.2) [.2,.4) [.4,.6) [.6,.8) [.8,1]; the 1.0 goes in the last bin by default
    conf, correct = [0.9, 0.85, 0.3, 1.0], [1, 1, 1, 0]
    # last bin: conf (0.9+0.85+1)/3, acc 2/3, weight 3/4; bin 1: conf 0.3, acc 1, weight 1/4
    assert expected_calibration_error(conf, correct, 5) == pytest.approx(0.75 * 0.25 + 0.25 * 0.7)
    assert maximum_calibration_error(conf, correct, 5) == pytest.approx(0.7)
    assert rms_calibration_error(conf, correct, 5) == pytest.approx(math.sqrt(0.75 * 0.0625 + 0.25 * 0.49))
    # torchmetrics' convention: the 1.0 forms its own bin with gap 1
    assert expected_calibration_error(conf, correct, 5, ones_in_last_bin=False) == pytest.approx(
        0.5 * 0.125 + 0.25 * 1.0 + 0.25 * 0.7)
    assert maximum_calibration_error(conf, correct, 5, ones_in_last_bin=False) == pytest.approx(1.0)
    probs = [[c] + [(1 - c) / 3] * 3 for c in conf]
    labels = [0 if ok else 1 for ok in correct]
    tm = float(multiclass_calibration_error(torch.tensor(probs), torch.tensor(labels), 4, n_bins=5))
    assert tm == pytest.approx(0.4875, abs=1e-6)
    r = calibration_metrics(confidences=conf, correct=correct, n_bins=5)
    assert r.brier_top == pytest.approx((0.01 + 0.0225 + 0.49 + 1.0) / 4)
    assert r.sce is None and r.accuracy == 0.75
    rel = reliability_data(conf, correct, 5)
    assert rel.count == [0, 1, 0, 0, 3] and math.isnan(rel.accuracy[0])
    assert rel.confidence[4] == pytest.approx(2.75 / 3) and rel.accuracy[1] == 1.0
    # confidence exactly 0 lands in the first bin; one sample is its own gap
    assert expected_calibration_error([0.0], [1], 5) == pytest.approx(1.0)
    assert reliability_data([0.0, 0.2], [0, 0], 5).count == [1, 1, 0, 0, 0]


def _nixon_reference(p, y, bins):
    """Straight numpy transcription of Nixon et al.'s SCE and ACE definitions."""
    p, y = np.asarray(p), np.asarray(y)
    n, k = p.shape
    sce = 0.0
    edges = np.linspace(0, 1, bins + 1)
    for c in range(k):
        for b in range(bins):
            lo, hi = edges[b], edges[b + 1]
            m = (p[:, c] >= lo) & ((p[:, c] < hi) if b < bins - 1 else (p[:, c] <= hi))
            if m.any():
                sce += m.sum() / n * abs((y[m] == c).mean() - p[m, c].mean())
    gaps = []
    for c in range(k):
        order = np.argsort(p[:, c], kind="stable")
        for chunk in np.array_split(order, min(bins, n)):
            gaps.append(abs((y[chunk] == c).mean() - p[chunk, c].mean()))
    return sce / k, float(np.mean(gaps))


@pytest.mark.parametrize("n,k,bins", [(3, 3, 15), (50, 4, 5), (1000, 10, 15)])
def test_classwise_metrics_match_nixon_definitions(n, k, bins):
    p, y = _random_probs(n, k, n + k)
    sce, ace = _nixon_reference(p.numpy(), y.numpy(), bins)
    assert static_calibration_error(p, y, bins) == pytest.approx(sce, abs=1e-12)
    assert adaptive_calibration_error(p, y, bins) == pytest.approx(ace, abs=1e-12)


def test_brier_nll_and_thresholded_ace():
    p, y = _random_probs(400, 6, 9)
    onehot = F.one_hot(y, 6).double()
    assert brier_score(p, y) == pytest.approx(float(((p - onehot) ** 2).sum(1).mean()))
    assert negative_log_likelihood(p, y) == pytest.approx(float(F.nll_loss(p.log(), y)))
    # perfectly calibrated one-hot predictions: every metric is 0
    r = calibration_metrics(onehot, y)
    assert (r.ece, r.mce, r.rms, r.sce, r.ace, r.brier, r.nll) == pytest.approx((0,) * 7, abs=1e-9)
    assert adaptive_calibration_error(p, y, 10, threshold=0.01) != adaptive_calibration_error(p, y, 10)


@pytest.mark.parametrize("kwargs,match", [
    (dict(probs=[[0.5, 0.6]], labels=[0]), "sum to 1"),
    (dict(probs=[[1.5, -0.5]], labels=[0]), r"\[0, 1\]"),
    (dict(probs=[[0.5, 0.5]], labels=[0, 1]), "1 rows but `labels` has 2"),
    (dict(probs=[[0.5, 0.5]], labels=[2]), "class indices"),
    (dict(probs=torch.zeros(0, 3), labels=[]), "empty"),
    (dict(probs=[[float("nan"), 1.0]], labels=[0]), "NaN"),
    (dict(confidences=[0.2, 0.3], correct=[1]), "same length"),
    (dict(confidences=[1.2], correct=[1]), "logits"),
    (dict(confidences=[0.2], correct=[2]), "0/1"),
    (dict(confidences=[0.2], correct=[1], n_bins=0), "n_bins"),
])
def test_bad_inputs_name_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        calibration_metrics(**kwargs)


def test_evaluate_metric_module_matches(monkeypatch):
    import evaluate

    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    metric = evaluate.load(evaluate_metric_path())
    p, y = _random_probs(64, 4, 11)
    got = metric.compute(predictions=p.tolist(), references=y.tolist(), n_bins=10)
    want = calibration_metrics(p, y, n_bins=10).scalars()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k


def test_reliability_diagram_png(tmp_path):
    p, y = _random_probs(200, 4, 12)
    path = tmp_path / "d" / "rel.png"
    reliability_diagram(calibration_metrics(p, y), str(path), title="random")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_reliability_diagram_into_the_callers_axes_leaves_its_layout(tmp_path):
    """Drawn into axes of the caller's figure, a diagram leaves that figure's layout to the caller: each panel of a
    grid re-laid the whole figure (half the time of the demo's grids). ``reliability_grid`` still lays its figure
    out, once, and saves it."""
    from matplotlib.figure import Figure

    from hf_lsce.calibration import reliability_grid

    res = calibration_metrics(*_random_probs(200, 4, 12))
    fig = Figure(figsize=(8, 4))
    axes = fig.subplots(1, 2)
    before = vars(fig.subplotpars).copy()
    for ax in axes:
        reliability_diagram(res, ax=ax, title="random")
    assert vars(fig.subplotpars) == before
    path = tmp_path / "grid.png"
    grid = reliability_grid({"a": res, "b": res}, str(path))
    assert vars(grid.subplotpars) != vars(Figure().subplotpars)  # (laid out: not matplotlib's default margins)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------- tasks
def test_mmlu_prompt_exact_text(shared_data):
    t = load_task("mmlu", shared_data, shots=5)
    it = next(i for i in t.items if i.subject == "abstract_algebra")
    want = ("The following are multiple choice questions (with answers) about abstract algebra.\n\n"
            "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\nA. 0\nB. 1\nC. 2\nD. 3\nAnswer: B\n\n")
    text = it.render()
    assert text.startswith(want)
    assert text.endswith("Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q."
                         "\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:")
    assert text.count("\nAnswer: ") == 5 and it.gold == 1 and len(t) == 14042
    assert it.render(0) == "The following are multiple choice questions (with answers) about abstract algebra." \
                           "\n\n" + it.context
    # limit is spread round-robin over the subjects
    assert len({i.subject for i in load_task("mmlu", shared_data, limit=57).items}) == 57


def test_mmlu_original_headerless_csv(tmp_path):
    for split, rows in (("dev", ["q0,a,b,c,d,C"]), ("test", ['"What, if?",w,x,y,z,D', "q2,1,2,3,4,A"])):
        (tmp_path / split).mkdir()
        (tmp_path / split / f"high_school_physics_{split}.csv").write_text("\n".join(rows) + "\n")
    t = load_task("mmlu", str(tmp_path), shots=1)
    assert [i.gold for i in t.items] == [3, 0]
    assert t.items[0].render() == ("The following are multiple choice questions (with answers) about high school "
                                   "physics.\n\nq0\nA. a\nB. b\nC. c\nD. d\nAnswer: C\n\nWhat, if?\nA. w\nB. x\n"
                                   "C. y\nD. z\nAnswer:")


def test_hellaswag_and_arc_formats(shared_data):
    h = load_task("hellaswag", shared_data)
    assert len(h) == 1000
    assert h.items[0].context == ("Pole vault: Pole vault is a sport where you run with a pole and stop and swing "
                                  "your body. A few women")
    assert h.items[0].choices[3] == " are in the gym practicing to do this pole vault, trying to do their best."
    assert all("[" not in c for it in h.items for c in it.choices)
    a = load_task("arc_challenge", shared_data, limit=3)
    assert a.items[0].context.startswith("Question: ") and a.items[0].context.endswith("?\nAnswer:")
    assert len(load_task("arc_easy", shared_data)) == 2376 and a.items[0].choices[0].startswith(" ")


def test_task_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'mmlux'"):
        load_task("mmlux", str(tmp_path))
    with pytest.raises(ValueError, match="unknown task names"):
        parse_task_names("mmlu,hella")
    assert parse_task_names("mmlu, arc") == ["mmlu", "arc_easy", "arc_challenge"]
    with pytest.raises(FileNotFoundError, match="no MMLU data"):
        load_task("mmlu", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="HellaSwag"):
        load_task("hellaswag", str(tmp_path))
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val.jsonl").write_text('{"ctx_a": "x", "label": 0}\n')
    with pytest.raises(ValueError, match=r"hellaswag_val.jsonl: line 1 lacks the field"):
        load_task("hellaswag", str(tmp_path))
    with pytest.raises(ValueError, match="no items"):
        Task("empty", "continuation", [])
    with pytest.raises(ValueError, match="gold index 4"):
        Task("bad", "letters", [MultipleChoiceItem("q", ["a", "b"], 4)])


# ------------------------------------------------------------------------------------- scoring
@pytest.fixture(scope="module")
def tiny_lm(shared_data_module):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_lsce.tokenizer import train_bpe_tokenizer

    tasks = {n: load_task(n, shared_data_module, limit=6) for n in ("mmlu", "hellaswag", "arc_easy", "arc_challenge")}
    texts = [it.render() + " ".join(it.choices) for t in tasks.values() for it in t.items]
    tok = train_bpe_tokenizer(texts, vocab_size=800)
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # confident enough for non-trivial calibration
    return model, tok, tasks


def _unpadded_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


@pytest.mark.parametrize("name", ["mmlu", "hellaswag", "arc_easy", "arc_challenge"])
def test_scoring_matches_unpadded_single_sequences(tiny_lm, name):
    model, tok, tasks = tiny_lm
    task = tasks[name]
    s = score_task(model, tok, task, batch_size=4, progress=False)
    assert s.probs.shape == (6, 4) and torch.allclose(s.probs.sum(1), torch.ones(6), atol=1e-5)
    for i, it in enumerate(task.items):
        prompt = it.render()
        ctx = tok(prompt).input_ids
        if task.kind == "letters":
            letters = [tok(prompt + " " + L).input_ids[-1] for L in "ABCD"]
            want = torch.softmax(_unpadded_logprobs(model, ctx)[-1, letters], -1)
        else:
            ll = []
            for c in it.choices:
                whole = tok(prompt + c).input_ids
                lp = _unpadded_logprobs(model, whole)
                ll.append(sum(float(lp[p - 1, whole[p]]) for p in range(len(ctx), len(whole))))
            want = torch.softmax(torch.tensor(ll, dtype=torch.float64), -1)
            assert s.loglik[i].tolist() == pytest.approx(ll, rel=1e-4, abs=1e-4)
        assert s.probs[i].double().tolist() == pytest.approx(want.tolist(), abs=2e-4)
    want_acc = float((s.probs.argmax(1) == s.labels).double().mean())
    assert s.metrics.accuracy == want_acc and s.shots_used == [len(it.shots) for it in task.items]
    assert (s.acc_norm is None) == (task.kind == "letters")


def test_scoring_drops_shots_to_fit_context(tiny_lm):
    model, tok, tasks = tiny_lm
    task = tasks["mmlu"]
    longest = max(len(tok(it.render()).input_ids) for it in task.items)
    zero_shot = max(len(tok(it.render(0)).input_ids) for it in task.items)
    s = score_task(model, tok, task, max_length=(longest + zero_shot) // 2, progress=False)
    assert min(s.shots_used) < 5
    with pytest.raises(ValueError, match="even without shots"):
        score_task(model, tok, task, max_length=zero_shot - 1, progress=False)


def test_callback_logs_and_draws_in_a_trainer(tiny_lm, tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_lsce.calibration import CalibrationCallback

    model, tok, tasks = tiny_lm
    model = type(model)(model.config)  # a fresh copy to train
    ids = [tok(it.render(0)).input_ids[:48] for it in tasks["arc_easy"].items]
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, per_device_eval_batch_size=1, max_steps=2,
                             eval_strategy="steps", eval_steps=2, report_to=[], logging_steps=1,
                             use_cpu=True, label_smoothing_factor=0.1)
    trainer = Trainer(model=model, args=args, train_dataset=ds, eval_dataset=ds.select(range(2)),
                      processing_class=tok)
    cb = CalibrationCallback([tasks["mmlu"], tasks["arc_easy"]], n_bins=10).attach(trainer)
    trainer.train()
    logged = {k for row in trainer.state.log_history for k in row}
    for key in ("eval_calib/mmlu_ece", "eval_calib/mmlu_rms", "eval_calib/mmlu_acc", "eval_calib/arc_easy_ece",
                "eval_calib/arc_easy_acc_norm", "eval_calib/arc_easy_nll"):
        assert key in logged, key
    row = next(r for r in trainer.state.log_history if "eval_calib/mmlu_ece" in r)
    assert row["step"] == 2 and 0 <= row["eval_calib/mmlu_ece"] <= 1
    png = tmp_path / "calibration" / "mmlu_step2.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    hist = json.loads((tmp_path / "calibration" / "history.json").read_text())
    assert hist[0]["eval_calib/mmlu_ece"] == row["eval_calib/mmlu_ece"] and len(cb.history) == 1


def test_cli_eval_writes_table_json_and_diagrams(tiny_lm, tmp_path, shared_data, capsys):
    from hf_lsce.cli import main

    model, tok, _ = tiny_lm
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    out = tmp_path / "out"
    argv = ["eval", "--model", str(tmp_path / "m"), "--tasks", "mmlu,arc", "--data-dir", shared_data,
            "--limit", "5", "--output-dir", str(out), "--dtype", "fp32", "--device", "cpu"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "arc_challenge" in text and "ece" in text
    rep = json.loads((out / "calibration.json").read_text())
    assert set(rep["tasks"]) == {"mmlu", "arc_easy", "arc_challenge"}
    for r in rep["tasks"].values():
        assert r["n"] == 5 and all(math.isfinite(r[k]) for k in ("acc", "ece", "rms", "nll"))
        assert os.path.exists(r["diagram"])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(argv) == 2  # earlier results are not replaced without --overwrite
    err = capsys.readouterr().err
    assert "--overwrite" in err and err.count("\n") == 1
    assert main(argv[:3] + ["--tasks", "mmlu,bogus"] + argv[5:] + ["--overwrite"]) == 2
    assert "unknown task names" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing written or removed


def test_two_processes_score_shards_and_gather(tiny_lm, tmp_path, shared_data):
    import subprocess
    import sys

    model, tok, _ = tiny_lm
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    script = os.path.join(os.path.dirname(__file__), "scripts", "dist_score.py")
    out = tmp_path / "res.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    script, str(tmp_path / "m"), shared_data, str(out)], check=True, env=env, timeout=300)
    res = json.loads(out.read_text())
    for name in ("mmlu", "arc_easy"):
        single = score_task(model, tok, load_task(name, shared_data, limit=7), batch_size=3, progress=False)
        assert res[name]["world"] == 2
        assert torch.allclose(torch.tensor(res[name]["probs"]), single.probs, atol=1e-5)
        assert res[name]["ece"] == pytest.approx(single.metrics.ece, abs=1e-5)


def test_paired_bootstrap_against_direct_metrics():
    """The two sides equal calibration_metrics on the same items; identical predictions give a zero interval;
    flattening overconfident predictions is a clear ECE change, resampling noise is not."""
    from hf_lsce.calibration import calibration_metrics, paired_bootstrap

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(300, 4, generator=g)
    y = torch.randint(0, 4, (300,), generator=g)
    p = torch.softmax(logits, -1)
    flat = torch.softmax(logits / 4, -1)
    d = paired_bootstrap(p, flat, y, metric="ece", n_bins=15, n_boot=200)
    assert d.a == pytest.approx(calibration_metrics(p, y).ece) and d.b == pytest.approx(calibration_metrics(flat, y).ece)
    assert d.significant and d.diff < 0 and d.low <= d.diff <= d.high
    same = paired_bootstrap(p, p, y, metric="acc", n_boot=50)
    assert same.diff == 0 and same.low == same.high == 0 and not same.significant
    with pytest.raises(ValueError, match="metric"):
        paired_bootstrap(p, p, y, metric="auc")


def test_scoring_with_a_tokenizer_larger_than_the_model_says_so(tiny_lm):
    """Another model's (larger) tokenizer: a ValueError naming the tokenizer and the fix, not an IndexError from the
    embedding lookup. Simulated by shrinking the model's embeddings below the ids this tokenizer produces."""
    model, tok, tasks = tiny_lm
    small = copy.deepcopy(model)
    small.resize_token_embeddings(8)
    with pytest.raises(ValueError, match="tokenizer does not belong to this model"):
        score_task(small, tok, tasks["hellaswag"], batch_size=4, progress=False)
