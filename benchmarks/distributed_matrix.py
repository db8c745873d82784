"""The patch under every distributed engine users launch, on 2 or more GPUs: engaged? right? and what it buys at 8B.

    python benchmarks/distributed_matrix.py matrix [--out DIR] [--full] [--gpus N]   # engines x precision x trainer
    python benchmarks/distributed_matrix.py 8b [--out DIR]                             # Llama-3-8B, FSDP2 and ZeRO-3

Each row is one ``torchrun --nproc_per_node N`` of tests/scripts/engine_step.py (the worker the CPU tests use; N: every
visible GPU, or ``--gpus``, one of 2, 4 and 8): HF ``Trainer`` or TRL ``SFTTrainer``, ``label_smoothing_factor=0.1``,
a randomly initialised Llama, sequences with unequal label counts, global batch 16 (8 / N per GPU x N GPUs x gradient
accumulation 2), 4 SGD steps, patched or stock, against one GPU in fp32 (unpatched, 8 per step x 2) as the
reference. Columns: lm_head calls that returned
the full logits (0 = the fused op ran everywhere), fused calls, the dtype of the loss handed to backward, the
losses logged, and the largest relative difference of any weight from the reference.

``8b``: the Llama-3-8B configuration (V = 128,256), bf16 weights, gradient checkpointing, ``--optim`` (default
``adamw_torch_fused``, as users fine-tune), under the Trainer's FSDP2 auto-wrap and ZeRO-3: tokens/s (the median of
the steps after the first) and peak memory per GPU, stock and patched, at growing tokens per GPU until one runs out of
memory (a row saying so, at that size; the next configuration still runs); on 2 GPUs.

Rows already in OUT/rows are not run again (an interrupted run resumes). Writes OUT/distributed_matrix.json and
.md. Needs 2 or more GPUs, transformers, TRL, DeepSpeed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "engine_step.py"
# Not here: FSDP2 sharded by the user (fully_shard) before the Trainer. The Trainer's FSDP2 set-up then looks for
# LlamaDecoderLayer among the renamed FSDPLlamaDecoderLayer classes and stops (ValueError, seen on 2 x H200).
ENGINES = ["ddp", "fsdp2", "zero1", "zero2", "zero3"]
COMMON = ["--size", "small", "--seq", "256", "--steps", "4", "--lr", "0.1", "--device", "cuda"]


def run_row(out: Path, name: str, args: list[str], nproc: int, timeout: int = 900) -> dict:
    """One worker run (cached in out/rows/NAME); its result.json, with the error or the log's tail on failure."""
    row = out / "rows" / name
    if (row / "result.json").exists():
        return json.loads((row / "result.json").read_text())
    row.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc_per_node", str(nproc)]
    if nproc == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    try:
        res = subprocess.run([*launcher, str(WORKER), str(row), *args], env=env, capture_output=True, text=True,
                             timeout=timeout)
        (row / "log.txt").write_text(res.stdout[-20000:] + res.stderr[-20000:])
        failed = res.returncode != 0 or not (row / "result.json").exists()
        tail = (res.stderr or res.stdout)[-1500:]
    except subprocess.TimeoutExpired:
        failed, tail = True, f"timed out after {timeout} s"
    if failed:
        oom = "OutOfMemoryError" in tail or "out of memory" in tail
        result = {"error": "out of memory" if oom else f"exit: {tail}", "oom": oom}
        (row / "result.json").write_text(json.dumps(result))
        return result
    return json.loads((row / "result.json").read_text())


def rel_diff(row_dir: Path, ref_dir: Path) -> float | None:
    a, b = row_dir / "state.pt", ref_dir / "state.pt"
    if not (a.exists() and b.exists()):
        return None
    s, r = torch.load(a), torch.load(b)
    return max(float((s[k].float() - r[k].float()).norm() / r[k].float().norm()) for k in r)


def matrix(out: Path, full: bool, only: tuple[str, ...] = (), gpus: int = 2) -> list[dict]:
    if gpus not in (2, 4, 8):
        raise ValueError(f"--gpus must be 2, 4 or 8 (the global batch of 16 is 8 / gpus per GPU x gpus x 2), "
                         f"got {gpus}.")
    rows = []
    refs = {}
    for kind in ("trainer", "sft"):
        name = f"reference_{kind}"
        res = run_row(out, name, [*COMMON, "--engine", "single", "--trainer", kind, "--patch", "0",
                                  "--per-device", "8", "--accum", "2"], nproc=1)
        refs[kind] = out / "rows" / name
        rows.append({"name": name, "engine": "1 GPU", "precision": "fp32", "trainer": kind, "patch": 0, **res})
    for engine in ENGINES:
        for precision in ("bf16", "fp32"):
            for kind in ("trainer", "sft"):
                for patch in (1, 0):
                    # full: every combination; else the SFT rows in bf16 (what users run), stock SFT under ZeRO-3
                    if not full and kind == "sft" and (precision == "fp32" or (patch == 0 and engine != "zero3")):
                        continue
                    name = f"{engine}_{precision}_{kind}_{'patched' if patch else 'stock'}"
                    if only and not name.startswith(only):
                        continue
                    res = run_row(out, name, [*COMMON, "--engine", engine, "--precision", precision, "--trainer",
                                              kind, "--patch", str(patch), "--per-device", str(8 // gpus), "--accum",
                                              "2"], nproc=gpus)
                    res["weight_diff"] = rel_diff(out / "rows" / name, refs[kind])
                    rows.append({"name": name, "engine": engine, "precision": precision, "trainer": kind,
                                 "patch": patch, **res})
                    print(fmt_row(rows[-1]), flush=True)
    return rows


def rows_8b(out: Path, only: tuple[str, ...] = (), sizes: tuple[int, ...] = (1, 4, 8), optim: str = "adamw_torch_fused",
            steps: int = 4) -> list[dict]:
    rows = []  # FSDP2 (the auto-wrap) and ZeRO-3 at growing tokens per GPU (sizes x 8192) until out of memory
    for engine in ("fsdp2", "zero3"):
        for patch in (0, 1):
            for per_device in sizes:  # x 8192 tokens per GPU
                name = f"8b_{engine}_{'patched' if patch else 'stock'}_{per_device * 8}k_{optim}"
                if only and not name.startswith(only):
                    continue
                res = run_row(out, name, ["--size", "8b", "--seq", "8192", "--steps", str(steps), "--device", "cuda",
                                          "--engine", engine, "--precision", "bf16", "--patch", str(patch),
                                          "--per-device", str(per_device), "--accum", "1", "--checkpointing", "1",
                                          "--lr", "1e-5", "--optim", optim, "--state", "0"], nproc=2)
                rows.append({"name": name, "engine": engine, "patch": patch, "tokens_per_gpu": per_device * 8192,
                             **res})
                print(fmt_row(rows[-1]), flush=True)
                if res.get("error"):
                    break
    return rows


def fmt_row(r: dict) -> str:
    if r.get("error"):
        return f"{r['name']:34s} ERROR {str(r['error'])[:200]}"
    wd = r.get("weight_diff")
    return (f"{r['name']:34s} logits {r.get('full_logit_calls')!s:>3} fused {r.get('fused_calls')!s:>3} "
            f"loss {','.join(r.get('loss_dtypes') or [])!s:8s} losses {[round(x, 4) for x in r.get('losses', [])]} "
            f"weights {'' if wd is None else f'{wd:.2e}'} tok/s {r.get('tokens_per_s') or 0:,.0f} "
            f"peak {r.get('peak_gib') or 0:.1f} GiB")


def markdown(rows: list[dict], kind: str) -> str:
    if kind == "8b":
        lines = [f"optim={rows[0].get('optim', 'sgd') if rows else '-'}, bf16, checkpointing, tokens/s the median of the "
                 "steps after the first", "", "| engine | patched | tokens per GPU | tokens/s | peak GiB per GPU | "
                 "lm_head logits calls |", "|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("error"):  # out of memory: a row saying at which step (the steps before it logged a loss)
                what = (f"out of memory at step {len(r.get('losses') or []) + 1}" if "out of memory" in r["error"].lower()
                        else r["error"][:60])
                lines.append(f"| {r['engine']} | {'yes' if r['patch'] else 'no'} | {r['tokens_per_gpu']:,} | {what} | | |")
            else:
                tps = r.get("tokens_per_s_median") or r["tokens_per_s"]
                lines.append(f"| {r['engine']} | {'yes' if r['patch'] else 'no'} | {r['tokens_per_gpu']:,} | "
                             f"{tps:,.0f} ({r.get('timed_steps', 1)} steps) | {r['peak_gib']:.1f} | {r['full_logit_calls']} |")
        return "\n".join(lines)
    lines = ["| engine | precision | trainer | patched | lm_head calls returning logits | fused calls | loss dtype | "
             "first / last loss | weights vs 1-GPU fp32 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['engine']} | {r['precision']} | {r['trainer']} | {'yes' if r['patch'] else 'no'} | "
                         f"error: {r['error'][:80]} | | | | |")
            continue
        wd = r.get("weight_diff")
        losses = r.get("losses") or [float("nan")]
        lines.append(f"| {r['engine']} | {r['precision']} | {r['trainer']} | {'yes' if r['patch'] else 'no'} | "
                     f"{r['full_logit_calls']} | {r['fused_calls']} | {','.join(r.get('loss_dtypes') or [])} | "
                     f"{losses[0]:.5f} / {losses[-1]:.5f} | {'reference' if wd is None else f'{wd:.2e}'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["matrix", "8b"])
    p.add_argument("--out", default="distributed_out")
    p.add_argument("--full", action="store_true", help="every engine x precision x trainer x patch combination")
    p.add_argument("--only", default="", help="matrix: comma-separated prefixes of the row names to run")
    p.add_argument("--gpus", type=int, default=None, help="matrix: processes (GPUs) per run, 2, 4 or 8 (default: "
                                                        "every visible GPU)")
    p.add_argument("--sizes", default="1,4,8", help="8b: sequences of 8192 tokens per GPU, growing; each "
                                                   "configuration stops at its first failure (out of memory)")
    p.add_argument("--optim", default="adamw_torch_fused", help="8b: the Trainer's optimizer")
    p.add_argument("--steps", type=int, default=4, help="8b: optimizer steps per row (the first is not timed)")
    a = p.parse_args(argv)
    gpus = a.gpus or torch.cuda.device_count()
    if torch.cuda.device_count() < max(2, gpus):
        sys.exit(f"distributed_matrix.py needs {max(2, gpus)} GPUs (it launches torchrun --nproc_per_node {gpus}); "
                 f"{torch.cuda.device_count()} visible.")
    if a.what == "8b":
        gpus = 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    only = tuple(x for x in a.only.split(",") if x)
    rows = matrix(out, a.full, only, gpus) if a.what == "matrix" else rows_8b(
        out, only, tuple(int(x) for x in a.sizes.split(",")), a.optim, a.steps)
    info = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__}
    for mod in ("transformers", "trl", "accelerate", "deepspeed"):  # None: not installed
        info[mod] = importlib.import_module(mod).__version__ if importlib.util.find_spec(mod) else None
    suffix = a.what + ("_" + "_".join(only) if only else "")
    (out / f"distributed_{suffix}.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    md = markdown(rows, a.what)
    (out / f"distributed_{suffix}.md").write_text(md + "\n")
    print(json.dumps(info))
    print(md)


if __name__ == "__main__":
    main()
