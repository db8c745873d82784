"""The release as a user installs it: ``python -m build`` makes the sdist and the wheel, and the wheel, installed
outside the checkout (a virtual environment over this environment's packages; not editable), runs ``hf-lsce env
--json``, one patched Trainer step and the op's and the patch's refusals, every command started from a folder outside
the checkout."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, timeout=900, check=True):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=dict(env, CUDA_VISIBLE_DEVICES=""), capture_output=True,
                       text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, (cmd, r.stdout[-1500:], r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the venv's python, its hf-lsce, a folder outside the checkout, the dist folder) with the built wheel in it."""
    out = tmp_path_factory.mktemp("release")
    dist = out / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", dist, ROOT], cwd=out)
    _run([sys.executable, "-m", "venv", "--system-site-packages", out / "venv"], cwd=out)
    python = out / "venv" / "bin" / "python"
    wheel = next(dist.glob("hf_lsce-*.whl"))
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=out)
    work = out / "work"
    work.mkdir()
    return python, out / "venv" / "bin" / "hf-lsce", work, dist


def test_build_makes_the_sdist_and_the_wheel_with_what_the_package_reads(installed):
    """Version 1.0.0; the wheel holds every module, the calibration metric script ``evaluate`` loads by path, and the
    ``hf-lsce`` entry point; the sdist holds the sources and the README."""
    from hf_lsce import __version__

    _, _, _, dist = installed
    wheel, sdist = next(dist.glob("*.whl")), next(dist.glob("*.tar.gz"))
    assert __version__ == "1.0.0" and wheel.name == "hf_lsce-1.0.0-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "hf_lsce").rglob("*.py")}
    assert modules <= names, sorted(modules - names)[:5]
    entry = zipfile.ZipFile(wheel).read("hf_lsce-1.0.0.dist-info/entry_points.txt").decode()
    assert "hf-lsce = hf_lsce.cli:main" in entry
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    assert {"README.md", "setup.cfg", "pyproject.toml", "hf_lsce/ops/fused_pass.py"} <= members


def test_the_installed_wheel_runs_env_outside_the_checkout(installed):
    """The installed package (not the checkout's) answers ``hf-lsce env --json``: its version, and a self-test that
    passed on this machine (the CPU's torch computation)."""
    python, cli, work, _ = installed
    where = _run([python, "-c", "import hf_lsce; print(hf_lsce.__file__)"], cwd=work).stdout.strip()
    assert str(ROOT) not in where and "venv" in where, where
    info = json.loads(_run([cli, "env", "--json"], cwd=work).stdout)
    assert info["versions"]["hf_lsce"] == "1.0.0" and info["passed"] is True


STEP = r'''
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.trainer_pt_utils import LabelSmoother
from hf_lsce import apply_lsce_patch
from hf_lsce.patching import ENGAGEMENT

cfg = LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
torch.manual_seed(0)
stock = LlamaForCausalLM(cfg)
model = LlamaForCausalLM(cfg)
model.load_state_dict(stock.state_dict())
ids = torch.randint(0, 500, (8, 16), generator=torch.Generator().manual_seed(1))
rows = [{"input_ids": r, "labels": r} for r in ids]
with torch.no_grad():
    want = float(LabelSmoother(epsilon=0.1)(stock(input_ids=ids[:4]), ids[:4], shift_labels=True))
    got = float(apply_lsce_patch(model, label_smoothing=0.1, memory="low")(input_ids=ids[:4], labels=ids[:4]).loss)
calls = []
model.lm_head.register_forward_hook(lambda *a: calls.append(1))
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=1, label_smoothing_factor=0.1,
                         use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
before = ENGAGEMENT.fused_calls
Trainer(model=model, args=args, train_dataset=rows).train()
print(json.dumps(dict(want=want, got=got, fused=ENGAGEMENT.fused_calls - before, lm_head_calls=len(calls),
                      file=__import__("hf_lsce").__file__)))
'''


def test_a_patched_trainer_step_from_the_installed_wheel(installed):
    """One Trainer step of a patched Llama (label_smoothing_factor 0.1, memory="low") from the installed wheel: the
    op ran once, the head never returned logits, and the patched loss is transformers' own smoothed loss."""
    python, _, work, _ = installed
    (work / "step.py").write_text(STEP)
    out = json.loads(_run([python, "step.py"], cwd=work).stdout.strip().splitlines()[-1])
    assert str(ROOT) not in out["file"]
    assert out["fused"] == 1 and out["lm_head_calls"] == 0
    assert abs(out["got"] - out["want"]) < 1e-5 * out["want"]


REFUSALS = r'''
import torch
from hf_lsce import apply_lsce_patch, linear_cross_entropy
h, w, y = torch.randn(4, 8, requires_grad=True), torch.randn(50, 8), torch.zeros(4, dtype=torch.long)
for call in (lambda: linear_cross_entropy(h, w, y, memory=-1), lambda: linear_cross_entropy(h, w, y, memory=100),
             lambda: linear_cross_entropy(h, w, y, label_smoothing=2.0), lambda: apply_lsce_patch("gpt2"),
             lambda: apply_lsce_patch(memory="tiny")):
    try:
        call()
        print("no error")
    except (TypeError, ValueError) as e:
        print(type(e).__name__, str(e).splitlines()[0][:160])
'''


def test_the_installed_wheel_keeps_its_refusals(installed):
    """Bad input gets its one line from the installed wheel, as from the checkout: a memory budget below zero or below
    the smallest that works (naming it), a smoothing outside [0, 1], a model name instead of a model, and the CLI's
    exit status 2 for a missing model."""
    python, cli, work, _ = installed
    (work / "refuse.py").write_text(REFUSALS)
    lines = _run([python, "refuse.py"], cwd=work).stdout.strip().splitlines()
    assert lines[0].startswith("ValueError memory=-1") and "positive number of bytes" in lines[0]
    assert lines[1].startswith("ValueError memory=100: below what the op needs") and "smallest budget" in lines[1]
    assert lines[2].startswith("ValueError label_smoothing must lie in [0, 1]")
    assert lines[3].startswith("TypeError model must be a loaded transformers model")
    assert lines[4].startswith("ValueError memory must be 'auto', 'low' or a number of bytes")
    r = _run([cli, "eval", "--model", str(work / "no_such_model"), "--tasks", "arc_easy"], cwd=work, check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "hf-lsce eval: error" in r.stderr
