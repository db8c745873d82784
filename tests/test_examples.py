"""The examples run: each script's --tiny mode, and every notebook, executed top to bottom on CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _run(script, args, cwd, timeout=600):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True,
                         env=env, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout


def test_sft_label_smoothing_example(tmp_path, shared_data):
    out = _run("sft_label_smoothing.py", ["--tiny", "--dataset", os.path.join(shared_data, "alpaca", "alpaca_en_demo.json"),
                                          "--data-dir", shared_data, "--output-dir", str(tmp_path / "sft")], tmp_path)
    last = json.loads(out.split("calibration at the last evaluation:")[1])
    assert last["step"] == 20 and 0 <= last["eval_calib/arc_easy_ece"] <= 1
    assert (tmp_path / "sft" / "model.safetensors").exists()
    assert (tmp_path / "sft" / "calibration" / "history.json").exists()


def test_evaluate_calibration_example(tmp_path, shared_data):
    _run("evaluate_calibration.py", ["--tiny", "--data-dir", shared_data, "--tasks", "mmlu,arc_easy",
                                     "--output-dir", str(tmp_path / "eval")], tmp_path)
    summary = json.loads((tmp_path / "eval" / "calibration.json").read_text())
    assert set(summary) == {"mmlu", "arc_easy"}
    assert all(0 <= s["ece"] <= 1 and 0 <= s["acc"] <= 1 for s in summary.values())
    assert (tmp_path / "eval" / "mmlu.png").stat().st_size > 0


def test_train_ats_example(tmp_path):
    out = _run("train_ats.py", ["--tiny", "--output-dir", str(tmp_path / "ats")], tmp_path)
    assert "+ ATS" in out and (tmp_path / "ats" / "config.json").exists()
    base_row = next(line for line in out.splitlines() if line.startswith("base"))
    ats_row = next(line for line in out.splitlines() if line.startswith("+ ATS"))
    assert base_row.split()[1] == ats_row.split()[2]  # ATS never changes the argmax: same accuracy


@pytest.mark.parametrize("name", sorted(p.name for p in (EXAMPLES / "notebooks").glob("*.ipynb")))
def test_notebook_executes(name, tmp_path, request, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(EXAMPLES / "notebooks" / name, as_version=4)
    if "HF_LSCE_DATA" in nbformat.writes(nb):  # this notebook reads the task files
        monkeypatch.setenv("HF_LSCE_DATA", request.getfixturevalue("shared_data"))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert any(o.output_type == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])), "no figure drawn"
