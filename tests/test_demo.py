"""The main job (`hf-lsce demo --tiny`) end to end: report structure, finite numbers, files."""
import json
import math
import os

import pytest

from hf_lsce.demo import ATTRIBUTES, make_synthetic_facts


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


def test_demo_tiny_end_to_end(tmp_path, capsys):
    from hf_lsce.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--tiny", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "smoothing 0 + ATS" in printed and "report.json" in printed
    rep = json.loads((out / "report.json").read_text())
    rows = rep["results"]["facts"]
    assert set(rows) == {"smoothing 0", "smoothing 0.1", "smoothing 0 + ATS", "smoothing 0 + temperature scaling"}
    for r in rows.values():
        for k in ("acc", "ece", "rms", "nll"):
            assert math.isfinite(r[k]) and r[k] >= 0
        assert 0 <= r["acc"] <= 1 and os.path.exists(r["diagram"])
    # calibration was logged during both trainings
    for key in ("smoothing 0", "smoothing 0.1"):
        hist = rep["calibration_during_training"][key]
        assert hist and all("eval_calib/facts_ece" in h for h in hist)
    # ATS never changes which token ranks first; per-item accuracy of ATS/TS is measured, not assumed
    assert (out / "ats" / "model.safetensors").exists() and (out / "ts" / "config.json").exists()
    with pytest.raises(SystemExit, match="--overwrite"):
        main(["demo", "--tiny", "--output-dir", str(out)])
