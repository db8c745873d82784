"""The frameworks on GPUs through their own entry (``axolotl train cfg.yml``), as their users launch them: bf16 full
fine-tuning, LoRA, QLoRA and sample packing on one GPU, the stock run against hf_lsce's plugin and against the
framework's own Liger option; DeepSpeed ZeRO-3 and FSDP2 on several GPUs against one (``multi``). Axolotl (0.19 to
0.21) has no smoothing of its own (its config drops ``label_smoothing_factor``): at b > 0 the stock and Liger runs get
transformers' ``LabelSmoother(b)`` from the probe (tools/frameworks/probe.py), what the key does in the HF Trainer.
Random weights of real configurations (benchmarks/bench_trainer.py's CONFIGS), SmolLM2's tokenizer, rows of a few
hundred tokens from ../shared/data's Alpaca file.

Here, once (a device call carries at most 64 MiB, and the GPU machine has no registry):
    python tools/frameworks_gpu.py prepare --wheels DIR
writes the tokenizer and the rows to .gpu/fw/ and DIR's wheels (tools/frameworks/axolotl_gpu_wheels.txt says which
and how to download them) as one archive split into parts in .gpu/stage/; .gpu/extra/ holds the wheels added since
(python-dotenv, DeepSpeed built here as a pure-Python wheel, hjson). Then, one device call each, back to back:
    bash tools/gpu/fw_session.sh put 0        # 1, 2: carry that part
    bash tools/gpu/fw_session.sh go python3 tools/frameworks_gpu.py run --models gemma3-270m-config,llama3.2-1b \
        --modes full,lora,qlora,packed --variants stock,lsce,liger --b 0.1 --parallel 4 --out $OUT/fw.json
    bash tools/gpu/fw_session.sh go python3 tools/frameworks_gpu.py multi --gpus 4 --out $OUT/fw_multi.json
    bash tools/gpu/fw_session.sh go python3 tools/frameworks_gpu.py largest --gpus 4 --out $OUT/fw_8b.json
(``largest``: Llama-3-8B's configuration, FSDP2, sequence 8,192, the largest micro-batch of stock and hf_lsce.)
LLaMA-Factory: the same with ``FW_ARCHIVE=lf_wheels.tar`` and ``--framework llamafactory`` (``run``; ``multi
--engines zero3``; ``largest --engine zero3``).
Per run, from inside each training process (tools/frameworks/probe.py): every loss, the lm_head calls that returned
logits, hf_lsce's per-step check, each step's wall time (the device synchronised at step boundaries), input tokens and
scored labels, the device's peak allocated memory (``run --profile``: where three steps' time goes, by operator).
Tokens/s is over the steps after the first ``WARMUP``. Rows are
written after each run, so a call stopped at its limit keeps what ran.
    python tools/frameworks_gpu.py table RESULTS.json [...]
prints the markdown tables of docs/frameworks.md.
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
ZERO3 = ROOT / "examples" / "axolotl" / "zero3_bf16.json"  # the shipped example's DeepSpeed config (bf16 on)
# FSDP2 as examples/axolotl/lsce_llama3_8b_fsdp2.yml sets it (the layer class filled in per model)
FSDP2 = ["fsdp_version: 2", "fsdp_config:", "  offload_params: false", "  cpu_ram_efficient_loading: true",
         "  auto_wrap_policy: TRANSFORMER_BASED_WRAP", "  transformer_layer_cls_to_wrap: {layer}",
         "  state_dict_type: FULL_STATE_DICT", "  reshard_after_forward: true"]
LAYER_CLASS = {"llama": "LlamaDecoderLayer", "gemma3_text": "Gemma3DecoderLayer"}
# several GPUs against one: each step's global loss rebuilt from the ranks' (judge_multi) against the one-GPU run of
# the same global batch, both fp32
MULTI_RTOL = 1e-5
# the first loss against stock smoothing's, relative: bf16 weights, the same batch; stock takes bf16 logits' fp32 upcast,
# the op sums in fp32 in another order
FIRST_LOSS_RTOL = 1e-4


def prepare(wheels: str | None, archive_name: str = "fw_wheels.tar") -> None:
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
        archive = ROOT / ".gpu" / archive_name
        with tarfile.open(archive, "w") as t:
            for w in sorted(Path(wheels).glob("*.whl")):
                t.add(w, arcname=f"whl/{w.name}")
        subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "gpu_stage.py"), "split", str(archive),
                        "--dir", str(ROOT / ".gpu" / "stage"), "--part-mb", "48"], check=True)
    print(f"{len(out)} rows in {FW / 'data'}")


def make_model(name: str, precision: str = "bf16") -> Path:
    """bench_trainer's configuration ``name``, random weights (seed 0) saved in bf16, or, for ``precision="fp32"``,
    the same weights saved in fp32 (LLaMA-Factory loads a checkpoint in its config's dtype and upcasts only trainable
    parameters: a bf16 checkpoint would leave LoRA's base in bf16), with the carried tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if precision == "fp32":
        path = MODEL_DIR / f"{name}-fp32"
        if not (path / "config.json").exists():
            bf16 = make_model(name)
            AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32).save_pretrained(path)
            AutoTokenizer.from_pretrained(bf16).save_pretrained(path)
        return path
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
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # (the CPU: a dry run of this script)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def zero3_config(precision: str, folder: Path) -> Path:
    """The DeepSpeed config of a ZeRO-3 run: the shipped example (bf16 on) or, for fp32 runs, a copy with bf16 off
    written into ``folder``.
    Not "auto": Axolotl loads the model under ZeRO-3 before the Trainer fills "auto", and DeepSpeed reads an unfilled
    "auto" as off, so the weights are partitioned and trained in fp32 (measured: about 6 x slower, docs/frameworks.md)."""
    if precision == "bf16":
        return ZERO3
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "zero3_fp32.json"
    path.write_text(json.dumps({**json.loads(ZERO3.read_text()), "bf16": {"enabled": False}}, indent=1))
    return path


def axolotl_yaml(model: Path, out: Path, mode: str, variant: str, b: float, *, seq: int = SEQ,
                 micro_batch: int = MICRO_BATCH, steps: int = STEPS, precision: str = "bf16", engine: str | None = None,
                 sequential: bool = False, checkpointing: bool = False, data: Path | None = None) -> str:
    """The YAML of one run. ``engine``: None (one process), "zero3" (the shipped ZeRO-3 example's DeepSpeed config)
    or "fsdp2"; ``sequential``: Axolotl's ``curriculum_sampling`` (the rows in order, so that N GPUs' first step
    trains on the one-GPU run's first batch); ``precision``: "bf16" or "fp32" (tf32 off)."""
    packed = mode in ("packed", "full_packed")
    plugins = {"stock": [], "lsce": ["hf_lsce.integrations.axolotl.LscePlugin"],
               "liger": ["axolotl.integrations.liger.LigerPlugin"]}[variant] + ["probe.ProbePlugin"]
    lines = [f"base_model: {model}", "datasets:", f"  - path: {data or FW / 'data' / 'train.jsonl'}", "    ds_type: json",
             "    type: alpaca", f"sequence_len: {seq}", f"sample_packing: {str(packed).lower()}",
             f"pad_to_sequence_len: {str(packed).lower()}", f"micro_batch_size: {micro_batch}",
             "gradient_accumulation_steps: 1", f"max_steps: {steps}", "num_epochs: 1", "learning_rate: 0.00001",
             "optimizer: adamw_torch_fused", "lr_scheduler: constant", f"output_dir: {out}", "val_set_size: 0",
             "save_strategy: 'no'", "logging_steps: 1", "seed: 0", "dataloader_num_workers: 2",
             *(["bf16: true"] if precision == "bf16" else ["bf16: false", "fp16: false", "tf32: false"]),
             "sdp_attention: true", f"label_smoothing_factor: {b}",
             # (each run prepares its own copy: runs side by side on several GPUs never share the folder)
             f"dataset_prepared_path: {out}_prepared", "plugins:", *[f"  - {p}" for p in plugins]]
    if sequential:
        lines += ["curriculum_sampling: true"]
    if checkpointing:
        lines += ["gradient_checkpointing: true"]
    if engine == "zero3":
        lines += [f"deepspeed: {zero3_config(precision, out.parent)}"]
    elif engine == "fsdp2":
        layer = LAYER_CLASS[json.loads((model / "config.json").read_text())["model_type"]]
        lines += [x.format(layer=layer) for x in FSDP2]
    if variant == "liger":  # only the loss: Liger's other kernels off, as hf_lsce changes only the loss
        lines += ["liger_fused_linear_cross_entropy: true", "liger_rope: false", "liger_rms_norm: false",
                  "liger_glu_activation: false", "liger_layer_norm: false", "liger_cross_entropy: false"]
    if mode in ("lora", "qlora", "packed"):
        lines += [f"adapter: {'qlora' if mode == 'qlora' else 'lora'}", "lora_r: 16", "lora_alpha: 32",
                  "lora_dropout: 0.0", "lora_target_linear: true"]
    if mode == "qlora":
        lines += ["load_in_4bit: true"]
    return "\n".join(lines) + "\n"


def llamafactory_yaml(model: Path, out: Path, mode: str, variant: str, b: float, *, seq: int = SEQ,
                      micro_batch: int = MICRO_BATCH, steps: int = STEPS, precision: str = "bf16",
                      engine: str | None = None, sequential: bool = False, checkpointing: bool = True,
                      data: Path | None = None) -> str:
    """LLaMA-Factory's YAML of the same run. Its Trainer smooths by itself (``label_smoothing_factor``), so stock
    needs no help; Liger is its ``enable_liger_kernel`` (all of Liger's kernels for the model, its fused loss among
    them); ``lsce_liger``: the route with ``enable_liger_kernel`` (Liger's other kernels, hf_lsce's loss);
    ``engine``: None or "zero3" (the same DeepSpeed config); ``sequential``: ``disable_shuffling``;
    ``checkpointing``: LLaMA-Factory's default, on (False writes ``disable_gradient_checkpointing``); ``data``: a rows
    file with a ``dataset_info.json`` beside it naming it by its stem (``largest`` writes both), else the prepared
    rows."""
    full = mode in ("full", "full_packed")
    lines = [f"model_name_or_path: {model}", "stage: sft", "do_train: true",
             f"finetuning_type: {'full' if full else 'lora'}", f"dataset: {data.stem if data else 'long_rows'}",
             f"dataset_dir: {data.parent if data else FW / 'data'}", "template: default", f"cutoff_len: {seq}",
             "overwrite_cache: true",
             "preprocessing_num_workers: 4", f"output_dir: {out}", "overwrite_output_dir: true",
             f"per_device_train_batch_size: {micro_batch}", "gradient_accumulation_steps: 1", f"max_steps: {steps}",
             "learning_rate: 1.0e-5", "lr_scheduler_type: constant", "optim: adamw_torch_fused", "logging_steps: 1",
             "save_strategy: 'no'", "report_to: none", "seed: 0", "dataloader_num_workers: 2", "flash_attn: sdpa",
             *(["bf16: true"] if precision == "bf16" else ["bf16: false", "fp16: false", "tf32: false"]),
             f"label_smoothing_factor: {b}"]
    if sequential:
        lines += ["disable_shuffling: true"]
    if not checkpointing:
        lines += ["disable_gradient_checkpointing: true"]
    if engine == "zero3":
        lines += [f"deepspeed: {zero3_config(precision, out.parent)}"]
    elif engine is not None:
        raise ValueError(f"LLaMA-Factory runs here: engine None or 'zero3', not {engine!r}")
    if variant in ("liger", "lsce_liger"):
        lines += ["enable_liger_kernel: true"]
    if not full:
        lines += ["lora_target: all", "lora_rank: 16", "lora_alpha: 32", "lora_dropout: 0.0"]
    if mode == "qlora":
        lines += ["quantization_bit: 4"]
    if mode in ("packed", "full_packed"):
        lines += ["packing: true"]
    return "\n".join(lines) + "\n"


def run_one(framework: str, model: Path, mode: str, variant: str, b: float, env: dict, *, gpus: str = "0",
            tag: str = "", **yaml_kw) -> dict:
    """One run on the GPUs ``gpus`` (CUDA_VISIBLE_DEVICES; several: one process each). Axolotl: ``axolotl train``
    (through its accelerate launcher); the stock and Liger variants at b > 0 get transformers' LabelSmoother from the
    probe, the HF Trainer's own smoothing, which Axolotl's config cannot ask for. LLaMA-Factory: its training entry
    (stock, Liger) or ``hf-lsce llamafactory train`` (hf_lsce), under ``torchrun`` on several GPUs, as its users
    launch the route (tools/frameworks/lf_probe_run.py)."""
    name = f"{framework}_{model.name}_{mode}_{variant}_b{b:g}{tag}"
    WORK.mkdir(parents=True, exist_ok=True)
    cfg, log, probe = WORK / f"{name}.yml", WORK / f"{name}.log", WORK / f"{name}.json"
    if framework == "axolotl" and variant == "lsce_liger":
        raise ValueError("variant lsce_liger is LLaMA-Factory's (the route with enable_liger_kernel); Axolotl's Liger "
                         "variant is its loss alone")
    make_yaml = axolotl_yaml if framework == "axolotl" else llamafactory_yaml
    cfg.write_text(make_yaml(model, WORK / name, mode, variant, b, **yaml_kw))
    for old in WORK.glob(f"{name}.json*"):
        old.unlink()
    n_gpus = len(gpus.split(","))
    port = str(29500 + abs(hash(name)) % 1000)
    if framework == "axolotl":
        cmd = ["axolotl", "train", str(cfg)]
        if n_gpus > 1:
            cmd += ["--", "--multi_gpu", "--num_processes", str(n_gpus), "--main_process_port", port]
    else:
        entry = [str(PROBE_DIR / "lf_probe_run.py"), "stock" if variant in ("stock", "liger") else "lsce", str(cfg)]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n_gpus), "--master-port",
                port, *entry] if n_gpus > 1 else [sys.executable, *entry])
    hf_b = b if framework == "axolotl" and variant != "lsce" else 0.0  # (LLaMA-Factory's Trainer smooths itself)
    run_env = {**env, "LSCE_PROBE_OUT": str(probe), "CUDA_VISIBLE_DEVICES": gpus,
               "LSCE_PROBE_HF_SMOOTHING": str(hf_b),
               "HF_DATASETS_CACHE": str(WORK / f"{name}_datasets")}  # (no cache shared by runs side by side)
    if env.get("LSCE_PROBE_PROFILE_DIR"):  # run / largest --profile: the probe's profile, beside the results
        run_env["LSCE_PROBE_PROFILE"] = str(Path(env["LSCE_PROBE_PROFILE_DIR"]) / f"{name}.prof.txt")
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=run_env, stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode
    row = dict(framework=framework, model=model.name, mode=mode, variant=variant, b=b, rc=rc, gpus=n_gpus,
               micro_batch=yaml_kw.get("micro_batch", MICRO_BATCH),
               engine=yaml_kw.get("engine"), precision=yaml_kw.get("precision", "bf16"),
               wall_s=round(time.time() - t0, 1), log=str(log))
    files = [probe] if n_gpus == 1 else [Path(f"{probe}.rank{r}") for r in range(n_gpus)]
    if rc != 0 or not all(f.exists() for f in files):
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        errors = [x for x in lines if "Error" in x or "error:" in x]
        row["error"] = (errors[-3:] if errors else lines[-3:])
        return row
    recs = [json.loads(f.read_text()) for f in files]
    rec = recs[0]
    # Axolotl resets the device's peak memory at each logging step and logs each step's peak: the largest of them
    framework_peaks = [float(h["memory/max_allocated (GiB)"]) for h in rec.pop("log_history", [])
                       if "memory/max_allocated (GiB)" in h and "loss" in h]
    if framework_peaks:
        rec["peak_gib"] = max(framework_peaks)
    if n_gpus > 1:  # every rank: its losses, its head calls, its check; the step loss is the mean over ranks
        for r in recs[1:]:
            r.pop("log_history", None)
        rec = dict(rec, rank_losses=[r["losses"] for r in recs],
                   rank_label_tokens=[r["step_label_tokens"] for r in recs],
                   losses=[sum(x) / n_gpus for x in zip(*[r["losses"] for r in recs])],
                   lm_head_logit_calls=sum(r["lm_head_logit_calls"] for r in recs),
                   confirmed=all(r["confirmed"] for r in recs), ranks_confirmed=[r["confirmed"] for r in recs],
                   step_tokens=[sum(x) for x in zip(*[r["step_tokens"] for r in recs])],
                   step_seconds=[max(x) for x in zip(*[r["step_seconds"] for r in recs])],
                   peak_gib=max(r["peak_gib"] or 0 for r in recs))
    secs, toks = _timed(rec["step_seconds"]), _timed(rec["step_tokens"])
    row.update(rec, timed_steps=len(secs), tokens_per_s=sum(toks) / sum(secs) if secs else None)
    return row


def _timed(per_step: list) -> list:
    """The timed steps' values: those after the first ``WARMUP`` (after the first only, in a run that short)."""
    return per_step[WARMUP if len(per_step) > WARMUP else 1:]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROBE_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "AXOLOTL_DO_NOT_TRACK": "1", "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false"}


def run(args) -> int:
    """The grid: one run per (model, mode, b, variant), ``--repeats`` times. With ``--parallel N`` the runs go N at a
    time, one per GPU, in row order, so a row's stock, hf_lsce and Liger runs train side by side under the same host
    load; each repeat runs the whole grid again with the variants' order rotated (another GPU each time)."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    env = _env()
    out = Path(args.out)
    if args.profile:
        env["LSCE_PROBE_PROFILE_DIR"] = str(out.resolve().parent)
    if args.no_cudnn_attention:
        env["LSCE_PROBE_NO_CUDNN_ATTENTION"] = "1"
    rows = json.loads(out.read_text()) if out.exists() else []
    size = dict(seq=args.seq, micro_batch=args.micro_batch, steps=args.steps, precision=args.precision)
    variants = args.variants.split(",")
    models = {name: make_model(name, args.precision) for name in args.models.split(",")}
    jobs = [(models[name], mode, float(b), variant, rep) for rep in range(args.repeats) for name in models
            for mode in args.modes.split(",") for b in args.b.split(",")
            for variant in variants[rep % len(variants):] + variants[:rep % len(variants)]]
    free: queue.Queue = queue.Queue()
    for k in range(args.parallel):
        free.put(str(k))

    def one(job):
        gpu = free.get()
        try:
            model, mode, b, variant, rep = job
            row = run_one(args.framework, model, mode, variant, b, env, gpus=gpu,
                          tag=f"_r{rep}" if args.repeats > 1 else "", **size)
            return dict(row, repeat=rep, gpu=int(gpu))
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(args.parallel) as pool:
        for row in pool.map(one, jobs):
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1) + "\n")
            print(_line(row), flush=True)
    print(table(rows))
    return 0


def multi(args) -> int:
    """Several GPUs through the framework's own launcher, fp32, against HF's smoothing on the same GPUs and against
    one GPU: per engine, stock and hf_lsce on G GPUs with micro-batch m each; the one-GPU run takes micro-batch
    G x m with the rows in order (the same global batch). Passes when every rank's check confirmed the op with no
    lm_head call returning logits and the global first loss equals the one-GPU run's to MULTI_RTOL (``judge_multi``;
    each rank against stock's and later steps reported)."""
    env = _env()
    out = Path(args.out)
    model = make_model(args.model, "fp32")
    g, m, b = args.gpus, args.micro_batch, float(args.b)
    kw = dict(seq=args.seq, steps=args.steps, precision="fp32", sequential=True)
    rows = [run_one(args.framework, model, "full", "lsce", b, env, gpus="0", tag="_1gpu", micro_batch=g * m, **kw)]
    for engine in args.engines.split(","):
        for variant in ("stock", "lsce"):
            rows.append(run_one(args.framework, model, "full", variant, b, env, gpus=",".join(map(str, range(g))),
                                tag=f"_{engine}{g}", micro_batch=m, engine=engine, **kw))
    judge_multi(rows)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(multi_table(rows))
    return 0 if all(r["passed"] for r in rows if r["variant"] == "lsce") else 1


def judge_multi(rows: list[dict]) -> None:
    """``multi``'s checks, written into its rows (rows[0]: the one-GPU run). Each G-GPU run's global loss against the
    one-GPU loss: with the Trainer's ``average_tokens_across_devices`` (LLaMA-Factory) each rank returns its token
    sum over the global count times G, so the global loss is the ranks' mean; Axolotl turns it off, each rank
    returns its own token mean, and the global loss is the ranks' losses weighted by their scored tokens. hf_lsce's
    runs also rank by rank against stock's on the same engine (reported: under FSDP2 stock's LabelSmoother is called
    without the causal shift, a transformers bug, docs/distributed.md), no lm_head call returning logits, every
    rank's check confirmed."""
    one_gpu = rows[0]
    ok = lambda r: not r.get("error")  # noqa: E731
    one_gpu["passed"] = ok(one_gpu) and one_gpu["lm_head_logit_calls"] == 0 and one_gpu["confirmed"]
    for r in rows[1:]:
        if not (ok(r) and ok(one_gpu)):
            r["passed"] = False
            continue
        if r.get("average_tokens_across_devices"):
            weighted = list(r["losses"])  # (the ranks' mean)
        else:
            weighted = [sum(x[k] * n[k] for x, n in zip(r["rank_losses"], r["rank_label_tokens"]))
                        / sum(n[k] for n in r["rank_label_tokens"]) for k in range(len(r["losses"]))]
        r["token_weighted_losses"] = weighted
        r["rel_error_vs_1gpu"] = [abs(x - y) / abs(y) for x, y in zip(weighted, one_gpu["losses"])]
        stock = next((s for s in rows[1:] if s.get("engine") == r["engine"] and s["variant"] == "stock"), None)
        if r["variant"] == "lsce" and stock is not None and ok(stock):
            r["rel_error_vs_stock_per_rank"] = [[abs(x - y) / abs(y) for x, y in zip(a, c)]
                                                for a, c in zip(r["rank_losses"], stock["rank_losses"])]
        r["passed"] = bool(r["rel_error_vs_1gpu"][0] < MULTI_RTOL and (
            r["variant"] == "stock" or (r["lm_head_logit_calls"] == 0 and r["confirmed"])))


def run_name(row: dict) -> str:
    """A several-GPU row's name in the tables: hf_lsce, or stock with the smoothing that stock ran (LLaMA-Factory's
    Trainer smooths by itself; under Axolotl the probe's LabelSmoother)."""
    if row["variant"] == "lsce":
        return "hf_lsce"
    return "stock (its smoothing)" if row.get("framework") == "llamafactory" else "stock (LabelSmoother)"


def multi_table(rows: list[dict]) -> str:
    one = rows[0]
    lines = ["| run | GPUs, micro-batch each | engine | first loss (global) | vs one GPU: steps 1, 2, 3 "
             "| vs stock on the same ranks (largest, step 1) | lm_head calls returning logits | ranks confirmed | "
             "passed |", "|---|---|---|---|---|---|---|---|---|"]
    lines.append(f"| hf_lsce | 1, {one.get('micro_batch', '-')} | - | {one['losses'][0]:.6f} | - | - | "
                 f"{one['lm_head_logit_calls']} | {one['confirmed']} | {'yes' if one['passed'] else 'NO'} |")
    for r in rows[1:]:
        if r.get("error"):
            lines.append(f"| {r['variant']} | {r['gpus']} | {r['engine']} | failed: {r['error'][-1][:80]} |||||")
            continue
        vs = r.get("rel_error_vs_stock_per_rank")
        lines.append(f"| {run_name(r)} | {r['gpus']}, "
                     f"{r.get('micro_batch', '-')} | {r['engine']} | {r['token_weighted_losses'][0]:.6f} | "
                     f"{', '.join('%.1e' % e for e in r['rel_error_vs_1gpu'])} | "
                     f"{'-' if vs is None else '%.1e' % max(e[0] for e in vs)} | {r['lm_head_logit_calls']} | "
                     f"{sum(r['ranks_confirmed'])} of {r['gpus']} | {'yes' if r['passed'] else 'NO'} |")
    return "\n".join(lines)


def largest(args) -> int:
    """The largest micro-batch each of stock (LabelSmoother) and hf_lsce fits, and tokens/s at each size, on G GPUs
    through the framework's launcher: the issue's Llama-3-8B case (its configuration with random weights, bf16, packed
    rows of ``--seq`` tokens, gradient checkpointing, AdamW; Axolotl with FSDP2 or ZeRO-3, LLaMA-Factory under
    ``torchrun`` with ZeRO-3). Sizes go up until a run fails; a failed run's log says whether it ran out of memory.
    Rows are written after each run."""
    if args.framework == "llamafactory" and args.engine != "zero3":
        raise SystemExit("largest --framework llamafactory runs DeepSpeed ZeRO-3 only: add --engine zero3")
    env = _env()
    if args.profile:  # the last step but one, on rank 0: NAME.prof.txt beside --out
        if args.steps < 3:
            raise SystemExit("largest --profile profiles the last step but one: give --steps 3 or more")
        env.update(LSCE_PROBE_PROFILE_DIR=str(Path(args.out).resolve().parent),
                   LSCE_PROBE_PROFILE_STEPS=f"{args.steps - 2},{args.steps - 1}")
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    model = make_model(args.model, args.precision)
    gpus = ",".join(map(str, range(args.gpus)))
    # enough packed rows for every step at the largest size: the 512 rows repeated
    need = max(int(x) for x in args.micro_batches.split(",")) * args.gpus * args.steps * args.seq
    rows_text = (FW / "data" / "train.jsonl").read_text()
    data = WORK / "train_repeated.jsonl"
    WORK.mkdir(parents=True, exist_ok=True)
    data.write_text(rows_text * (need // (512 * 300) + 1))  # (rows of 300 tokens or more)
    (WORK / "dataset_info.json").write_text(json.dumps({data.stem: {"file_name": data.name}}))  # (LLaMA-Factory's)
    for variant in args.variants.split(","):
        for m in [int(x) for x in args.micro_batches.split(",")]:
            row = run_one(args.framework, model, "full_packed", variant, float(args.b), env, gpus=gpus,
                          tag=f"_{args.engine}{args.gpus}_mb{m}", micro_batch=m, seq=args.seq, steps=args.steps,
                          engine=args.engine, checkpointing=True, data=data, precision=args.precision)
            row["tokens_per_gpu"] = m * args.seq
            # the allocator's settings decide where a size fits (expandable segments strand no reserved memory)
            row["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None
            failed = bool(row.get("error"))
            if failed:
                log = Path(row["log"])
                row["out_of_memory"] = "OutOfMemoryError" in log.read_text(errors="replace") if log.exists() else None
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1) + "\n")
            print(f"micro-batch {m} ({m * args.seq:,} tokens per GPU"
                  + (f", out of memory: {row['out_of_memory']}" if failed else "") + f"): {_line(row)}", flush=True)
            if failed:
                break
    return 0


def largest_table(rows: list[dict]) -> str:
    """``largest``'s rows: per variant and micro-batch, whether it fit, tokens/s and peak memory; then each variant's
    largest micro-batch that fit. Runs under another allocator setting (``PYTORCH_CUDA_ALLOC_CONF``) are named apart."""
    lines = [("| run | micro-batch per GPU (tokens) | fits | tok/s (all GPUs) | peak GiB (largest rank) | "
              "timed steps | lm_head calls returning logits | per-step check |"), "|---|---|---|---|---|---|---|---|"]
    best: dict = {}
    for r in rows:
        name = run_name(r) + (f", {r['alloc_conf']}" if r.get("alloc_conf") else "")
        size = f"{r['micro_batch']} ({r['tokens_per_gpu']:,})"
        if r.get("error"):
            why = "out of memory" if r.get("out_of_memory") else "failed: " + str(r["error"][-1])[:60]
            lines.append(f"| {name} | {size} | no: {why} | - | - | - | - | - |")
            continue
        best[name] = max(best.get(name, (0, 0)), (r["tokens_per_gpu"], r["tokens_per_s"]))
        lines.append(f"| {name} | {size} | yes | {r['tokens_per_s']:,.0f} | {r['peak_gib'] or 0:.1f} | "
                     f"{r['timed_steps']} | {r['lm_head_logit_calls']} | {r['confirmed']} |")
    lines += ["", "Largest that fit: " + "; ".join(f"{k} {t:,} tokens per GPU at {v:,.0f} tok/s"
                                                   for k, (t, v) in best.items())]
    return "\n".join(lines)


def _line(r: dict) -> str:
    if r.get("error"):
        return f"{r['model']} {r['mode']} {r['variant']} b={r['b']}: FAILED rc={r['rc']} {r['error']}"
    return (f"{r['model']} {r['mode']} {r['variant']} b={r['b']}: loss0 {r['losses'][0]:.6f} "
            f"{r['tokens_per_s']:.0f} tok/s peak {r['peak_gib'] or 0:.2f} GiB, lm_head logit calls "
            f"{r['lm_head_logit_calls']}, confirmed {r['confirmed']}, {r['wall_s']} s")


def median_tps(r: dict) -> float:
    """The median over the timed steps of each step's tokens/s: unlike ``tokens_per_s`` (their total over their
    time), not moved by one stalled step (a data-loader refill, a neighbour on the shared host)."""
    import statistics

    return statistics.median(t / s for t, s in zip(_timed(r["step_tokens"]), _timed(r["step_seconds"])))


def aggregate(runs: list[dict]) -> dict:
    """One (model, mode, b, variant)'s runs as one row: the median over its successful runs of ``tokens_per_s`` and of
    ``median_tps``, the largest peak and logit-call count, every check, the first run's losses, how many runs and the
    spread of their median tokens/s ((max - min) / median); the first failure where none succeeded."""
    import statistics

    good = [r for r in runs if not r.get("error")]
    if not good:
        return runs[0]
    tps = [median_tps(r) for r in good]
    return dict(good[0], tokens_per_s=statistics.median(r["tokens_per_s"] for r in good),
                median_tps=statistics.median(tps), peak_gib=max(r["peak_gib"] or 0 for r in good),
                lm_head_logit_calls=max(r["lm_head_logit_calls"] for r in good),
                confirmed=all(r["confirmed"] for r in good), runs=len(good), failed_runs=len(runs) - len(good),
                spread=(max(tps) - min(tps)) / statistics.median(tps))


def _ok(r: dict | None) -> bool:
    """A run (or aggregate) that trained: present and without an error."""
    return r is not None and not r.get("error")


def _grid(rows: list[dict]) -> dict:
    """{(model, mode, b): {variant: [runs]}}, in the rows' order: the grid's rows as ``table`` and ``plot`` show them."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["mode"], r["b"]), {}).setdefault(r["variant"], []).append(r)
    return groups


def table(rows: list[dict], ours: str = "lsce") -> str:
    """One line per (model, mode, b): stock, hf_lsce and Liger's tokens/s and peak memory, hf_lsce's ratios (over the
    timed steps' total, and of ``median_tps``), the first losses' relative difference, lm_head calls; repeated runs
    (``run --repeats``) as ``aggregate`` makes them one, with their count and the largest spread of the row.
    ``ours``: the variant in hf_lsce's columns (``lsce_liger``: LLaMA-Factory's route with Liger's other kernels)."""
    groups = _grid(rows)
    lines = ["| model | mode | b | stock tok/s, GiB | hf_lsce tok/s, GiB | Liger tok/s, GiB | hf_lsce / stock tok/s | "
             "hf_lsce / Liger tok/s | the same, median steps | hf_lsce / stock memory | first loss vs stock | lm_head "
             "logit calls (stock, hf_lsce) | per-step check | runs, spread |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r):
        if r is None:
            return "-"
        if r.get("error"):
            return "failed: " + str(r["error"][-1])[:80]
        return f"{r['tokens_per_s']:,.0f}, {r['peak_gib'] or 0:.1f}"

    def ratio(a, c, k):
        return f"{a[k] / c[k]:.2f} x" if _ok(a) and _ok(c) and a[k] and c[k] else "-"

    def med(a, c):
        return f"{a['median_tps'] / c['median_tps']:.2f}" if _ok(a) and _ok(c) else "-"

    for (model, mode, b), g in groups.items():
        s, o, lg = (aggregate(g[v]) if v in g else None for v in ("stock", ours, "liger"))
        err = abs(o["losses"][0] - s["losses"][0]) / abs(s["losses"][0]) if _ok(o) and _ok(s) else None
        first = "-" if err is None else f"{err:.1e} ({'ok' if err < FIRST_LOSS_RTOL else 'FAILED'})"
        calls = f"{s['lm_head_logit_calls'] if _ok(s) else '-'}, {o['lm_head_logit_calls'] if _ok(o) else '-'}"
        done = [x for x in (s, o, lg) if _ok(x)]
        runs = (f"{min(x['runs'] for x in done)}, {max(x['spread'] for x in done):.0%}"
                + (f" ({sum(x['failed_runs'] for x in done)} failed)" if any(x["failed_runs"] for x in done) else "")
                if done else "-")
        lines.append(f"| {model} | {mode} | {b:g} | {cell(s)} | {cell(o)} | {cell(lg)} | "
                     f"{ratio(o, s, 'tokens_per_s')} | {ratio(o, lg, 'tokens_per_s')} | {med(o, s)}, {med(o, lg)} | "
                     f"{ratio(o, s, 'peak_gib')} | {first} | {calls} | "
                     f"{o['confirmed'] if _ok(o) else '-'} | {runs} |")
    # what ran, from the records that name it (the probe's ``versions``): one line per distinct set, so that a grid
    # made of runs on two installations says so
    sets: dict[str, int] = {}
    for r in rows:
        if r.get("versions"):
            key = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
            sets[key] = sets.get(key, 0) + 1
    lines += [""] * bool(sets) + [f"Versions ({n} runs): {key}" for key, n in sets.items()]
    return "\n".join(lines)


PLOT_VARIANTS = {"stock": ("stock", "#7f7f7f"), "lsce": ("hf_lsce", "#1f77b4"),
                 "lsce_liger": ("hf_lsce + Liger's other kernels", "#17becf"), "liger": ("Liger", "#ff7f0e")}


def plot_series(rows: list[dict]) -> tuple[list[tuple], dict]:
    """What ``plot`` draws: the grid's (model, set-up, b) keys and, for each variant the rows hold (in
    ``PLOT_VARIANTS``' order), each key's peak GiB and median per-step tokens/s over stock's (0 where either failed or
    did not run), repeated runs aggregated as in ``table``."""
    groups = _grid(rows)
    keys = list(groups)
    present = [v for v in PLOT_VARIANTS if any(v in groups[g] for g in keys)]
    aggs = {v: [aggregate(groups[g][v]) if v in groups[g] else None for g in keys] for v in present}
    stock = aggs.get("stock", [None] * len(keys))
    series = {v: ([a["peak_gib"] if _ok(a) else 0 for a in aggs[v]],
                  [a["median_tps"] / s["median_tps"] if _ok(a) and _ok(s) else 0 for a, s in zip(aggs[v], stock)])
              for v in present}
    return keys, series


def plot(rows: list[dict], out: str, title: str = "") -> None:
    """The grid as a picture: per (model, set-up, b), each variant's peak memory (left) and its median per-step
    tokens/s relative to stock's (right, ``median_tps``; 1 = stock): ``plot_series``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys, series = plot_series(rows)
    labels = [f"{m.replace('-config', '')} {mode} b={b:g}" for m, mode, b in keys]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.14 * len(series) * len(keys) + 1.6), sharey=True)
    height = 0.8 / len(series)
    for k, (v, (peaks, rel)) in enumerate(series.items()):
        ys = [i + (k - (len(series) - 1) / 2) * height for i in range(len(keys))]
        name, color = PLOT_VARIANTS[v]
        left.barh(ys, peaks, height, color=color, label=name)
        right.barh(ys, rel, height, color=color, label=name)
    left.set_xlabel("peak allocated memory (GiB)")
    right.set_xlabel("median per-step tokens/s relative to stock")
    right.axvline(1.0, color="black", linewidth=0.8)
    left.set_yticks(range(len(keys)), labels)
    left.invert_yaxis()
    left.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("--wheels", help="a folder of wheels to stage for the device calls")
    pr.add_argument("--archive", default="fw_wheels.tar",
                    help="the staged archive's name: fw_wheels.tar (Axolotl's wheels), lf_wheels.tar (LLaMA-Factory's)")
    r = sub.add_parser("run")
    r.add_argument("--framework", default="axolotl", choices=["axolotl", "llamafactory"])
    r.add_argument("--models", default="gemma3-270m-config,llama3.2-1b")
    r.add_argument("--modes", default="full,lora,qlora,packed")
    r.add_argument("--variants", default="stock,lsce,liger")
    r.add_argument("--b", default="0.1")
    r.add_argument("--out", required=True)
    r.add_argument("--parallel", type=int, default=1, help="runs at a time, one per GPU")
    r.add_argument("--repeats", type=int, default=1, help="the grid this many times (the table: medians)")
    r.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    r.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    r.add_argument("--profile", action="store_true",
                   help="profile steps 7-9 of each run (torch.profiler): NAME.prof.txt beside --out")
    r.add_argument("--no-cudnn-attention", action="store_true",
                   help="every variant without cuDNN's SDPA (its per-shape graph builds stall steps on the host)")
    mu = sub.add_parser("multi", help="several GPUs (ZeRO-3, FSDP2) against one, fp32")
    mu.add_argument("--framework", default="axolotl", choices=["axolotl", "llamafactory"])
    mu.add_argument("--model", default="llama3.2-1b")
    mu.add_argument("--gpus", type=int, default=4)
    mu.add_argument("--engines", default="zero3,fsdp2")
    mu.add_argument("--micro-batch", type=int, default=2, help="per GPU")
    mu.add_argument("--b", default="0.1")
    mu.add_argument("--out", required=True)
    for q in (r, mu):
        q.add_argument("--seq", type=int, default=SEQ)
        q.add_argument("--steps", type=int, default=STEPS)
    lg = sub.add_parser("largest", help="the largest micro-batch of stock and hf_lsce on several GPUs (Llama-3-8B)")
    lg.add_argument("--framework", default="axolotl", choices=["axolotl", "llamafactory"])
    lg.add_argument("--model", default="llama3-8b")
    lg.add_argument("--gpus", type=int, default=4)
    lg.add_argument("--engine", choices=["fsdp2", "zero3"], default="fsdp2")
    lg.add_argument("--micro-batches", default="4,8,16", help="per GPU, ascending")
    lg.add_argument("--variants", default="stock,lsce")
    lg.add_argument("--seq", type=int, default=8192)
    lg.add_argument("--steps", type=int, default=8)
    lg.add_argument("--b", default="0.1")
    lg.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="fp32: a dry run on the CPU")
    lg.add_argument("--profile", action="store_true",
                    help="profile the last step but one on rank 0 (torch.profiler): NAME.prof.txt beside --out")
    lg.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    t.add_argument("--ours", default="lsce", choices=["lsce", "lsce_liger"], help="the variant in hf_lsce's columns")
    pl = sub.add_parser("plot", help="run's grid as a PNG: peak memory and tokens/s relative to stock per row")
    pl.add_argument("results", nargs="+")
    pl.add_argument("--out", required=True)
    pl.add_argument("--title", default="")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.wheels, args.archive)
        return 0
    if args.cmd == "run":
        return run(args)
    if args.cmd == "multi":
        return multi(args)
    if args.cmd == "largest":
        return largest(args)
    rows = [row for f in args.results for row in json.loads(Path(f).read_text())]
    if args.cmd == "plot":
        plot(rows, args.out, args.title)
        return 0
    if any("tokens_per_gpu" in r for r in rows):  # largest's rows
        print(largest_table(rows))
        return 0
    if any(r.get("engine") for r in rows):  # multi's rows
        judge_multi(rows)
        print(multi_table(rows))
        return 0
    print(table(rows, args.ours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
