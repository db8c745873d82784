"""`hf-lsce run` on unmodified scripts: the repo's stock Trainer script and TRL's own installed `sft.py`
(by path and as `-m trl.scripts.sft`), in fp32 and bf16, with gradient accumulation and with PEFT LoRA.

Each configuration runs twice in subprocesses, stock (`python script.py`) and through `hf-lsce run`, from the
same local checkpoint and data. The patched run must build no logits (a global hook counts calls of the
vocabulary-sized Linear), run the fused op once per micro-batch with the flag's smoothing, and end with the
stock run's losses and weights (bf16: within stock's own bf16-logit error, see test_training_matrix)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hf_lsce.patching.trainer import trl_defaults_to_chunked_loss

from tiny_models import V, save_checkpoint, save_sft_dataset

ROOT = Path(__file__).resolve().parent.parent
AUDIT = Path(__file__).parent / "scripts" / "audited_run.py"
STOCK_SCRIPT = ROOT / "examples" / "stock_trainer_script.py"


def _trl_sft_path() -> str:
    import trl.scripts.sft as sft

    return sft.__file__


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("assets")
    return save_checkpoint(d / "model"), save_sft_dataset(d / "data")


def _launch(mode, target, args, out_dir, tmp):
    audit = tmp / f"{mode}.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", AUDIT_VOCAB=str(V), AUDIT_JSON=str(audit),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="warning", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, str(AUDIT), mode, *target, *args, "--output_dir", str(out_dir)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(audit.read_text()), res.stderr


def _weights(out_dir):
    out_dir = Path(out_dir)
    f = out_dir / "model.safetensors"
    return load_file(f if f.exists() else out_dir / "adapter_model.safetensors")


def _compare(tmp, target, args, precision, ga, steps, checkpoint, adapter=False):
    """Run stock and patched, check the evidence and the results; returns the patched run's stderr."""
    common = [*args, "--seed", "0", "--max_steps", str(steps), "--gradient_accumulation_steps", str(ga),
              "--use_cpu", "--report_to", "none", "--logging_steps", "1", "--save_strategy", "no",
              "--label_smoothing_factor", "0.1", "--learning_rate", "0.5", "--optim", "sgd",
              "--lr_scheduler_type", "constant", "--max_grad_norm", "0"]
    common += ["--bf16", "true" if precision == "bf16" else "false"]  # TRL's SFTConfig defaults to bf16
    # TRL 1.x between its chunked loss and its fused head (1.9 to 1.14) defaults to a chunked loss that cannot smooth
    # (stock crashes under the LabelSmoother): stock smoothing there is its "nll" loss; the patched run is unchanged
    stock_extra = ["--loss_type", "nll"] if any("trl" in str(t) for t in target) and trl_defaults_to_chunked_loss() else []
    stock_audit, stock_err = _launch("stock", target, common + stock_extra, tmp / "stock", tmp)
    ours_audit, ours_err = _launch("patched", target, common, tmp / "ours", tmp)
    assert stock_audit["lm_head_calls"] > 0  # the audit sees the head when it runs
    assert ours_audit["lm_head_calls"] == 0, "hf-lsce run built logits"
    assert ours_audit["fused_calls"] == steps * ga and ours_audit["smoothing"] == [0.1]
    tol = 2e-4 if precision == "fp32" else 6e-2
    lines = [ln for ln in ours_err.splitlines() if "[hf_lsce]" in ln]
    assert lines and not any("[hf_lsce] hf_lsce:" in ln for ln in lines)
    assert "first training step ran through the fused op (label_smoothing=0.1" in ours_err
    if adapter and trl_defaults_to_chunked_loss():
        # TRL 1.14.2's sft script initialises LoRA's A unseeded: two stock runs of it ended 1.4 apart (relative), so
        # no run can be compared with another there; the evidence above still holds
        return stock_err, ours_err
    ws, wo = _weights(tmp / "stock"), _weights(tmp / "ours")
    assert ws.keys() == wo.keys()
    # updates: final minus the checkpoint's weights; LoRA: lora_B, which starts at zero (its value is its update)
    base = {} if adapter else load_file(Path(checkpoint) / "model.safetensors")
    keys = [k for k in ws if "lora_B" in k] if adapter else [k for k in ws if k in base]
    assert keys
    for k in keys:
        d_stock = ws[k].float() - (base[k].float() if k in base else 0)
        d_ours = wo[k].float() - (base[k].float() if k in base else 0)
        assert d_stock.norm() > 0, k
        assert float((d_ours - d_stock).norm() / d_stock.norm()) < tol, k
    return stock_err, ours_err


@pytest.mark.parametrize("precision,ga", [("fp32", 1), ("bf16", 4)])
def test_stock_trainer_script(assets, tmp_path, precision, ga):
    model, _ = assets
    _compare(tmp_path, [str(STOCK_SCRIPT)], ["--model_name_or_path", str(model), "--per_device_train_batch_size",
                                             str(8 // ga), "--num_examples", "16"], precision, ga, steps=2,
             checkpoint=model)


def _sft_args(model, data, ga):
    return ["--model_name_or_path", str(model), "--dataset_name", str(data), "--per_device_train_batch_size",
            str(8 // ga), "--dtype", "float32", "--completion_only_loss", "true"]


def test_trl_sft_module_bf16_with_accumulation(assets, tmp_path):
    """`hf-lsce run -m trl.scripts.sft`: TRL's own script, unmodified, bf16 through its flag, GA 2."""
    model, data = assets
    stock_err, ours_err = _compare(tmp_path, ["-m", "trl.scripts.sft"], _sft_args(model, data, 2), "bf16", 2, steps=2,
                                   checkpoint=model)
    if not trl_defaults_to_chunked_loss():  # (TRL 1.14.2 does not warn)
        assert "label_smoothing_factor` is deprecated" in stock_err  # TRL's warning, stock
    assert "label_smoothing_factor` is deprecated" not in ours_err  # replaced by our accurate line
    assert "no extra forward pass" in ours_err


def test_trl_sft_script_path_with_lora(assets, tmp_path):
    """`hf-lsce run .../trl/scripts/sft.py --use_peft`: LoRA adapters, frozen head; same adapter weights."""
    model, data = assets
    args = [*_sft_args(model, data, 1), "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0",
            "--lora_target_modules", "q_proj", "v_proj"]
    _compare(tmp_path, [_trl_sft_path()], args, "fp32", 1, steps=2, checkpoint=model, adapter=True)


def test_run_usage_errors(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for argv, msg in ((["run", "-m", "no_such_module_xyz"], "no module named"), (["run", str(tmp_path / "nope.py")],
                                                                                 "no such script")):
        res = subprocess.run([sys.executable, "-m", "hf_lsce.cli", *argv], capture_output=True, text=True, env=env,
                             timeout=120)
        assert res.returncode != 0 and msg in res.stderr
        assert "Traceback" not in res.stderr
