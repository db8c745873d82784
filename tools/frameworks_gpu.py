"""The frameworks on one GPU through their own entry (``axolotl train cfg.yml``), bf16, as their users launch them:
full fine-tuning, LoRA, QLoRA and sample packing, the stock run against hf_lsce's plugin and against the
framework's own Liger option. Axolotl (0.19 to 0.21) has no smoothing of its own: its config drops
``label_smoothing_factor``, so the stock and Liger runs are unsmoothed whatever ``--b`` says, and only hf_lsce's plugin
(which keeps the key since 2026-11-28) smooths; the first-loss column compares like with like at b = 0 only. Random weights of real configurations (benchmarks/bench_trainer.py's
CONFIGS), SmolLM2's tokenizer, rows of a few hundred tokens from ../shared/data's Alpaca file.

Here, once (a device call carries at most 64 MiB, and the GPU machine has no registry):
    python tools/frameworks_gpu.py prepare --wheels DIR
writes the tokenizer and the rows to .gpu/fw/ and DIR's wheels (tools/frameworks/axolotl_gpu_wheels.txt says which
and how to download them) as one archive split into parts in .gpu/stage/. Each device call carries a part
(``tools/gpu/gpu_stage.py put``); the last one joins them, installs the wheels into /tmp/site (``--target``, its bin/
on PATH: ``axolotl`` starts ``accelerate launch``) and runs
    python3 tools/frameworks_gpu.py run --framework axolotl --models gemma3-270m-config,llama3.2-1b \
        --modes full,lora,qlora,packed --variants stock,lsce,liger --b 0.1 --out $OUT/frameworks_gpu.json
Per run, from inside the training process (tools/frameworks/probe.py): every loss, the lm_head calls that returned
logits, hf_lsce's per-step check, each step's wall time (the device synchronised at step boundaries) and input
tokens, the device's peak allocated memory. Tokens/s is over the steps after the first ``--warmup``. Rows are written
after each run, so a call stopped at its limit keeps what ran.
    python tools/frameworks_gpu.py table RESULTS.json [...]
prints the markdown table of docs/frameworks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FW = ROOT / ".gpu" / "fw"
PROBE_DIR = ROOT / "tools" / "frameworks"
MODEL_DIR = Path("/tmp/fw_models")
WORK = Path("/tmp/fw_runs")
SEQ = 1024
MICRO_BATCH = 8
STEPS = 12
WARMUP = 4  # (stock LoRA's first three steps are slow)
# the first loss against stock smoothing's, relative: bf16 weights, the same batch; stock takes bf16 logits' fp32 upcast,
# the op sums in fp32 in another order
FIRST_LOSS_RTOL = 1e-4


def prepare(wheels: str | None) -> None:
    """The tokenizer, the rows (several Alpaca answers per row: 300-700 tokens) and the wheels' archive parts."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from hf_lsce.checkpoints import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    tok.save_pretrained(FW / "tokenizer")
    rows = json.loads((ROOT.parent / "shared" / "data" / "alpaca" / "alpaca_en_demo.json").read_text())
    out, k = [], 0
    while len(out) < 512:
        instruction, parts = rows[k % len(rows)]["instruction"], []
        while len(tok(" ".join(parts))["input_ids"]) < 300 + 50 * (len(out) % 8):
            parts.append(rows[k % len(rows)]["output"])
            k += 1
        out.append(dict(instruction=instruction, input="", output="\n\n".join(parts)))
    (FW / "data").mkdir(parents=True, exist_ok=True)
    with open(FW / "data" / "train.jsonl", "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
    (FW / "data" / "dataset_info.json").write_text(json.dumps({"long_rows": {"file_name": "train.jsonl"}}))
    if wheels:
        archive = ROOT / ".gpu" / "fw_wheels.tar"
        with tarfile.open(archive, "w") as t:
            for w in sorted(Path(wheels).glob("*.whl")):
                t.add(w, arcname=f"whl/{w.name}")
        subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "gpu_stage.py"), "split", str(archive),
                        "--dir", str(ROOT / ".gpu" / "stage"), "--part-mb", "48"], check=True)
    print(f"{len(out)} rows in {FW / 'data'}")


def make_model(name: str) -> Path:
    """bench_trainer's configuration ``name``, random weights (seed 0) in bf16, with the carried tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = MODEL_DIR / name
    if (path / "config.json").exists():
        return path
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_trainer import CONFIGS

    tok = AutoTokenizer.from_pretrained(FW / "tokenizer")
    spec = dict(CONFIGS[name])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def axolotl_yaml(model: Path, out: Path, mode: str, variant: str, b: float) -> str:
    packed = mode == "packed"
    plugins = {"stock": [], "lsce": ["hf_lsce.integrations.axolotl.LscePlugin"],
               "liger": ["axolotl.integrations.liger.LigerPlugin"]}[variant] + ["probe.ProbePlugin"]
    lines = [f"base_model: {model}", "datasets:", f"  - path: {FW / 'data' / 'train.jsonl'}", "    ds_type: json",
             "    type: alpaca", f"sequence_len: {SEQ}", f"sample_packing: {str(packed).lower()}",
             f"pad_to_sequence_len: {str(packed).lower()}", f"micro_batch_size: {MICRO_BATCH}",
             "gradient_accumulation_steps: 1", f"max_steps: {STEPS}", "num_epochs: 1", "learning_rate: 0.00001",
             "optimizer: adamw_torch_fused", "lr_scheduler: constant", f"output_dir: {out}", "val_set_size: 0",
             "save_strategy: 'no'", "logging_steps: 1", "seed: 0", "dataloader_num_workers: 2", "bf16: true",
             "sdp_attention: true", f"label_smoothing_factor: {b}",
             f"dataset_prepared_path: {WORK / ('prepared_' + model.name + ('_packed' if packed else ''))}",
             "plugins:", *[f"  - {p}" for p in plugins]]
    if variant == "liger":  # only the loss: Liger's other kernels off, as hf_lsce changes only the loss
        lines += ["liger_fused_linear_cross_entropy: true", "liger_rope: false", "liger_rms_norm: false",
                  "liger_glu_activation: false", "liger_layer_norm: false", "liger_cross_entropy: false"]
    if mode in ("lora", "qlora", "packed"):
        lines += [f"adapter: {'qlora' if mode == 'qlora' else 'lora'}", "lora_r: 16", "lora_alpha: 32",
                  "lora_dropout: 0.0", "lora_target_linear: true"]
    if mode == "qlora":
        lines += ["load_in_4bit: true"]
    return "\n".join(lines) + "\n"


def run_one(framework: str, model: Path, mode: str, variant: str, b: float, env: dict) -> dict:
    name = f"{framework}_{model.name}_{mode}_{variant}_b{b:g}"
    WORK.mkdir(parents=True, exist_ok=True)
    cfg, log, probe = WORK / f"{name}.yml", WORK / f"{name}.log", WORK / f"{name}.json"
    cfg.write_text(axolotl_yaml(model, WORK / name, mode, variant, b))
    probe.unlink(missing_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(["axolotl", "train", str(cfg)], env={**env, "LSCE_PROBE_OUT": str(probe)}, stdout=f,
                            stderr=subprocess.STDOUT, timeout=600).returncode
    row = dict(framework=framework, model=model.name, mode=mode, variant=variant, b=b, rc=rc,
               wall_s=round(time.time() - t0, 1))
    if rc != 0 or not probe.exists():
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        errors = [x for x in lines if "Error" in x or "error:" in x]
        row["error"] = (errors[-3:] if errors else lines[-3:])
        return row
    rec = json.loads(probe.read_text())
    # Axolotl resets the device's peak memory at each logging step and logs each step's peak: the largest of them
    framework_peaks = [float(h["memory/max_allocated (GiB)"]) for h in rec.pop("log_history", [])
                       if "memory/max_allocated (GiB)" in h and "loss" in h]
    if framework_peaks:
        rec["peak_gib"] = max(framework_peaks)
    secs, toks = rec["step_seconds"], rec["step_tokens"]
    timed = slice(WARMUP, None)
    row.update(rec, timed_steps=len(secs[timed]),
               tokens_per_s=sum(toks[timed]) / sum(secs[timed]) if secs[timed] else None)
    return row


def run(args) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false"}
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    for name in args.models.split(","):
        model = make_model(name)
        for mode in args.modes.split(","):
            for b in [float(x) for x in args.b.split(",")]:
                for variant in args.variants.split(","):
                    row = run_one(args.framework, model, mode, variant, b, env)
                    rows.append(row)
                    out.write_text(json.dumps(rows, indent=1) + "\n")
                    print(_line(row), flush=True)
    print(table(rows))
    return 0


def _line(r: dict) -> str:
    if r.get("error"):
        return f"{r['model']} {r['mode']} {r['variant']} b={r['b']}: FAILED rc={r['rc']} {r['error']}"
    return (f"{r['model']} {r['mode']} {r['variant']} b={r['b']}: loss0 {r['losses'][0]:.6f} "
            f"{r['tokens_per_s']:.0f} tok/s peak {r['peak_gib']:.2f} GiB, lm_head logit calls "
            f"{r['lm_head_logit_calls']}, confirmed {r['confirmed']}, {r['wall_s']} s")


def table(rows: list[dict]) -> str:
    """One line per (model, mode, b): stock, hf_lsce and Liger's tokens/s and peak memory, hf_lsce's ratios, the
    first losses' relative difference, lm_head calls."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["mode"], r["b"]), {})[r["variant"]] = r
    lines = ["| model | mode | b | stock tok/s, GiB | hf_lsce tok/s, GiB | Liger tok/s, GiB | hf_lsce / stock tok/s | "
             "hf_lsce / Liger tok/s | hf_lsce / stock memory | first loss vs stock | lm_head logit calls (stock, "
             "hf_lsce) | per-step check |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r):
        if r is None:
            return "-"
        if r.get("error"):
            return "failed: " + str(r["error"][-1])[:80]
        return f"{r['tokens_per_s']:,.0f}, {r['peak_gib']:.1f}"

    for (model, mode, b), g in groups.items():
        s, o, lg = g.get("stock"), g.get("lsce"), g.get("liger")
        ok = lambda r: r is not None and not r.get("error")  # noqa: E731
        ratio = lambda a, c, k: f"{a[k] / c[k]:.2f} x" if ok(a) and ok(c) else "-"  # noqa: E731
        err = abs(o["losses"][0] - s["losses"][0]) / abs(s["losses"][0]) if ok(o) and ok(s) else None
        first = "-" if err is None else f"{err:.1e} ({'ok' if err < FIRST_LOSS_RTOL else 'FAILED'})"
        calls = f"{s['lm_head_logit_calls'] if ok(s) else '-'}, {o['lm_head_logit_calls'] if ok(o) else '-'}"
        lines.append(f"| {model} | {mode} | {b:g} | {cell(s)} | {cell(o)} | {cell(lg)} | "
                     f"{ratio(o, s, 'tokens_per_s')} | {ratio(o, lg, 'tokens_per_s')} | "
                     f"{ratio(o, s, 'peak_gib')} | {first} | {calls} | "
                     f"{o['confirmed'] if ok(o) else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("--wheels", help="a folder of wheels to stage for the device calls")
    r = sub.add_parser("run")
    r.add_argument("--framework", default="axolotl", choices=["axolotl"])
    r.add_argument("--models", default="gemma3-270m-config,llama3.2-1b")
    r.add_argument("--modes", default="full,lora,qlora,packed")
    r.add_argument("--variants", default="stock,lsce,liger")
    r.add_argument("--b", default="0.1")
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.wheels)
        return 0
    if args.cmd == "run":
        return run(args)
    print(table([row for f in args.results for row in json.loads(Path(f).read_text())]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
