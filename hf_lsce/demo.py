"""``hf-lsce demo``: the whole story on a real checkpoint and real data, offline.

1. The base model (default SmolLM2-135M-Instruct, installed from the package registry) is scored on real
   ARC-Easy, SciQ, PIQA and MMLU items (the installed hub-schema data, or ``--data-dir`` files):
   accuracy, ECE, RMS, NLL.
2. ``hf-lsce diagnose``'s prediction for this model (:mod:`hf_lsce.diagnosis`): its signed calibration gap per
   task and on held-out instruction tokens, and whether smoothing at b helps, has little effect or hurts.
3. Full SFT through ``apply_lsce_patch`` with TRL's ``SFTTrainer``, twice from the same weights, data order
   and seed: label smoothing 0 and b. The instruction data is real and disjoint from the evaluation sets:
   TriviaQA and NQ-Open questions rendered as Alpaca-style instructions (or ``--dataset``, e.g.
   ``../shared/data/alpaca/alpaca_en_demo.json``). ``CalibrationCallback`` logs calibration while training.
4. ATS (selective smoothing loss) and scalar temperature scaling fitted on the unsmoothed model, on held-out
   instruction records.
5. One table (base, SFT b=0, SFT b, +ATS, +temperature scaling), paired-bootstrap statements of what moved
   and what did not, reliability diagrams side by side, and ``report.json``.

The budget scales with the machine (``--budget``): ``cpu`` (8 SFT steps, 40-60 items per task, MMLU zero-shot;
the README gives the time measured on 2 cores), ``gpu`` (300 SFT steps, 5-shot MMLU on 1,000 items, all of
ARC-Easy and SciQ, 1,000 PIQA items), ``tiny`` (CI). The numbers are what they are: the
report says which differences its evaluation set can resolve, whichever way they go.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DATA = "trivia_qa,nq_open"
DEFAULT_TASKS = "arc_easy,sciq,piqa,mmlu"  # three where small models are above chance, and the paper's MMLU


@dataclass(frozen=True)
class Budget:
    """How much the demo does: SFT steps and batch, ATS steps, items and shots per task."""

    name: str
    sft_steps: int
    batch_size: int
    max_length: int
    lr: float
    ats_steps: int
    limits: dict = field(default_factory=dict)
    shots: dict = field(default_factory=dict)
    records: int | None = None  # instruction records used (None: all)
    calibration_records: int = 256
    bf16: bool = False


BUDGETS = {
    "tiny": Budget("tiny", sft_steps=2, batch_size=4, max_length=96, lr=5e-5, ats_steps=2,
                   limits={"mmlu": 8, "arc_easy": 8, "sciq": 8, "piqa": 8}, shots={"mmlu": 0}, records=120,
                   calibration_records=16),
    "cpu": Budget("cpu", sft_steps=8, batch_size=8, max_length=128, lr=5e-5, ats_steps=10,
                  limits={"mmlu": 40, "arc_easy": 60, "sciq": 50, "piqa": 60}, shots={"mmlu": 0}, records=2000,
                  calibration_records=128),
    "gpu": Budget("gpu", sft_steps=300, batch_size=32, max_length=256, lr=2e-5, ats_steps=300,
                  limits={"mmlu": 1000, "arc_easy": None, "sciq": None, "piqa": 1000}, shots={"mmlu": 5}, records=None,
                  calibration_records=1024, bf16=True),
}


def token_records(records: list, plan: Budget) -> list:
    """The held-out instruction records whose next tokens the diagnosis, the demo and the sweep measure: the last
    64 on the GPU budget, 16 elsewhere (a forward pass each)."""
    return records[-min(len(records), 64 if plan.name == "gpu" else 16):]


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def choose_budget(budget: str = "auto", *, steps: int | None = None, ats_steps: int | None = None) -> Budget:
    """The named budget (``"auto"``: gpu with CUDA, else cpu), with ``steps`` / ``ats_steps`` over its own."""
    if budget == "auto":
        budget = "gpu" if torch.cuda.is_available() else "cpu"
    if budget not in BUDGETS:
        raise ValueError(f"budget must be 'auto' or one of {sorted(BUDGETS)}, got {budget!r}")
    plan = BUDGETS[budget]
    for name, v in (("steps", steps), ("ats_steps", ats_steps)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer; got {v!r}")
    if steps is not None or ats_steps is not None:
        plan = Budget(**{**asdict(plan), "sft_steps": steps or plan.sft_steps, "ats_steps": ats_steps or plan.ats_steps})
    return plan


def prepare(model: str, plan: Budget, eval_tasks: str, limit, dataset: str | None, data_dir: str | None,
            command: str = "demo"):
    """(checkpoint path, tokenizer with a pad token, shots per task, SFT records, held-out records, tasks): what the
    demo and the sweep start from."""
    from transformers import AutoTokenizer

    from .calibration.tasks import resolve_tasks
    from .checkpoints import resolve_model_path

    names, limits, shots = task_plan(eval_tasks, plan, limit)
    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train, held_out = instruction_split(dataset, names, data_dir, plan, command=command)
    return path, tokenizer, shots, train, held_out, resolve_tasks(names, data_dir, shots=shots, limit=limits)


def task_plan(eval_tasks: str, plan: Budget, limit=None) -> tuple[list[str], dict, dict]:
    """(task names, items per task, shots per task): the budget's, with ``limit`` (N, or per task) over it."""
    from .calibration.tasks import parse_per_task, parse_task_names

    names = parse_task_names(eval_tasks)
    limits = {n: plan.limits.get(n, 200 if plan.name != "tiny" else 8) for n in names}
    if limit is not None:
        limits.update({k: v for k, v in parse_per_task(limit, names, "limit", allow_zero=False).items() if v})
    return names, limits, {n: plan.shots.get(n, 0) for n in names}


def instruction_split(dataset: str | None, task_names: list[str], data_dir: str | None, plan: Budget,
                      command: str = "demo") -> tuple[list[dict], list[dict]]:
    """(SFT records, held-out records) of the instruction data (default TriviaQA + NQ-Open as instructions),
    refused when it overlaps the evaluation tasks, cut to the budget."""
    from .data import check_disjoint, load_instruction_records

    check_disjoint(dataset or DEFAULT_DATA, task_names)
    records = load_instruction_records(dataset or DEFAULT_DATA, data_dir=data_dir if dataset else None)
    if plan.records is not None:
        records = records[: plan.records + plan.calibration_records]
    n_cal = min(plan.calibration_records, max(1, len(records) // 5))
    if len(records) < 2 * n_cal:
        raise ValueError(f"{dataset or DEFAULT_DATA} gives {len(records)} records; the {command} needs at least "
                         f"{2 * n_cal} (training and a held-out split)")
    return records[:-n_cal], records[-n_cal:]


def _sft(path, tokenizer, train, eval_records, callback_task, *, label_smoothing, budget: Budget, output_dir, seed):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, set_seed
    from trl import SFTConfig, SFTTrainer

    from . import apply_lsce_patch
    from .calibration import CalibrationCallback

    set_seed(seed)
    dev = _device()
    model = apply_lsce_patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    steps = budget.sft_steps
    args = SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=budget.batch_size,
                     per_device_eval_batch_size=budget.batch_size, learning_rate=budget.lr, lr_scheduler_type="constant",
                     warmup_steps=0, label_smoothing_factor=label_smoothing, logging_steps=max(1, steps // 10),
                     eval_strategy="steps", eval_steps=max(1, steps // 2), save_strategy="no", report_to="none",
                     seed=seed, use_cpu=dev.type == "cpu", bf16=budget.bf16 and dev.type == "cuda",
                     max_length=budget.max_length, completion_only_loss=True, disable_tqdm=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(train),
                         eval_dataset=Dataset.from_list(eval_records), processing_class=tokenizer)
    cb = CalibrationCallback([callback_task], n_bins=10, batch_size=16, tokenizer=tokenizer,
                             save_diagrams=False).attach(trainer)
    t0 = time.perf_counter()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.model.eval(), {"history": cb.history, "train_loss": losses,
                                  "seconds": round(time.perf_counter() - t0, 1)}


def run_demo(output_dir: str = "hf_lsce_demo", *, model: str = DEFAULT_MODEL, dataset: str | None = None,
             eval_tasks: str = DEFAULT_TASKS, data_dir: str | None = None, label_smoothing: float = 0.1,
             budget: str = "auto", steps: int | None = None, ats_steps: int | None = None, limit=None,
             seed: int = 0) -> dict:
    """Run the demo; returns the report (also written to ``output_dir/report.json``)."""
    from .ats import ATSCalibrator
    from .ats.training import train_ats
    from .calibration import Task, paired_bootstrap, reliability_grid, score_task
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0 < label_smoothing <= 1:
        raise ValueError(f"label_smoothing must lie in (0, 1]; got {label_smoothing!r} (the demo compares it to 0)")
    plan = choose_budget(budget, steps=steps, ats_steps=ats_steps)
    t_start = time.perf_counter()

    # -------------------------------------------------------------------------- model and data
    from transformers import AutoModelForCausalLM

    path, tokenizer, shots, train, calib, tasks = prepare(model, plan, eval_tasks, limit, dataset, data_dir)
    dev = _device()
    logger.info("demo on %s (%s budget, %s): %d SFT records, %d calibration records, tasks %s", model, plan.name, dev,
                len(train), len(calib), {t.name: len(t) for t in tasks})

    def score_all(m, label):
        out = {}
        for t in tasks:
            logger.info("scoring %s on %s (%d items)", label, t.name, len(t))
            out[t.name] = score_task(m, tokenizer, t, batch_size=16, n_bins=10, progress=True)
        return out

    # -------------------------------------------------------------------------- 1-2: the base, and its diagnosis
    from .diagnosis import diagnose_model

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    logger.info("diagnosing the base model: its calibration now, and what smoothing at b would do to it")
    tok_records = token_records(calib, plan)  # the next tokens measured: the base's here, the fine-tunings' below
    with torch.no_grad():
        diag = diagnose_model(base, tokenizer, label_smoothing=label_smoothing, tasks=tasks, records=tok_records,
                              n_records=len(tok_records), b_grid=(0.05, 0.1, 0.2),
                              name=model, progress=True, n_bins=10)  # the demo's bins: its scores are the base row
    scores = {"base": diag.scores}  # the diagnosis scored the base on the same items
    diagnosis = {**diag.to_dict(), "text": diag.format()}
    del base
    gc.collect()

    # -------------------------------------------------------------------------- 3: SFT, b = 0 and b
    from .diagnosis import token_report

    sft, trained, tokens = {}, {}, {}
    watch = next((t for t in tasks if t.name == "arc_easy"), tasks[0])  # logged during training: a cheap task
    watch = Task(name=watch.name, kind=watch.kind, items=watch.items[:20], split=watch.split)
    for b in (0.0, label_smoothing):
        key = f"SFT b={b:g}"
        logger.info("fine-tuning with label smoothing %g through the fused op", b)
        m, info = _sft(path, tokenizer, train, calib[:32], watch, label_smoothing=b, budget=plan,
                       output_dir=os.path.join(output_dir, f"sft_b{b:g}"), seed=seed)
        trained[key], sft[key] = m.to(dev), info
        scores[key] = score_all(trained[key], key)
        tokens[key] = token_report(trained[key], tokenizer, tok_records, (label_smoothing,), predict=b == 0.0)
        if b != 0.0:
            del trained[key]
            gc.collect()

    # -------------------------------------------------------------------------- 4: ATS and temperature scaling
    base0 = trained["SFT b=0"]
    for p in base0.parameters():
        p.requires_grad_(False)
    fitted = {}
    for key, head, loss, lr in (("SFT b=0 + ATS", "transformer", "selective", 5e-4),
                                ("SFT b=0 + temperature", "scalar", "nll", 5e-2)):
        logger.info("fitting %s on %d held-out records", key, len(calib))
        cal = ATSCalibrator.from_base(base0, head_type=head, loss_type=loss)
        kw = {"bf16": True} if plan.bf16 and dev.type == "cuda" else {}
        cal = train_ats(base0, tokenizer, calib, calibrator=cal, max_steps=plan.ats_steps, learning_rate=lr,
                        per_device_train_batch_size=plan.batch_size, max_length=plan.max_length,
                        output_dir=os.path.join(output_dir, "ats" if head == "transformer" else "temperature"),
                        save_steps=max(plan.ats_steps, 1), logging_steps=max(1, plan.ats_steps // 5), seed=seed, **kw)
        scores[key] = score_all(cal, key)
        fitted[key] = cal

    # -------------------------------------------------------------------------- 5: report
    b_key = f"SFT b={label_smoothing:g}"
    comparisons = [("base", "SFT b=0", "ece"), ("SFT b=0", b_key, "ece"), ("SFT b=0", b_key, "acc"),
                   ("SFT b=0", "SFT b=0 + ATS", "ece"), ("SFT b=0", "SFT b=0 + ATS", "nll"),
                   ("SFT b=0", "SFT b=0 + temperature", "ece")]
    results, moved, diagrams = {}, {}, {}
    for t in tasks:
        results[t.name] = {k: {**v[t.name].summary(), "split": t.split} for k, v in scores.items()}
        moved[t.name] = []
        for a, b_, metric in comparisons:
            d = paired_bootstrap(scores[a][t.name].probs, scores[b_][t.name].probs, scores[a][t.name].labels,
                                 metric=metric, n_bins=10, seed=seed)
            moved[t.name].append({**asdict(d), "from": a, "to": b_, "significant": d.significant,
                                  "text": d.describe(a, b_)})
        png = os.path.join(output_dir, f"reliability_{t.name}.png")
        reliability_grid({k: v[t.name].metrics for k, v in scores.items()}, png,
                         title=f"{model} on {t.name} ({len(t)} items, split {t.split})")
        diagrams[t.name] = png
    report = {"output_dir": output_dir, "model": model, "checkpoint": path, "device": str(dev), "budget": asdict(plan),
              "label_smoothing": label_smoothing, "dataset": dataset or DEFAULT_DATA, "sft_records": len(train),
              "calibration_records": len(calib), "tasks": {t.name: {"n": len(t), "split": t.split, "source": t.source,
                                                                     "shots": shots[t.name]} for t in tasks},
              "diagnosis": diagnosis, "sft": sft, "tokens": tokens, "results": results, "what_moved": moved, "diagrams": diagrams,
              "seconds": round(time.perf_counter() - t_start, 1)}
    report["summary"] = _summary(report, label_smoothing)
    with open(os.path.join(output_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def _summary(report: dict, b: float) -> list[str]:
    """Plain sentences: what moved and what did not, and whether it matches the diagnosis."""
    lines = []
    b_key = f"SFT b={b:g}"
    for task, items in report["what_moved"].items():
        for d in items:
            if d["to"] == b_key and d["metric"] == "ece":
                lines.append(f"{task}: smoothing {b:g} vs 0: {d['text'].split(': ', 1)[1]}")
            if d["to"].endswith("ATS") and d["metric"] == "ece":
                lines.append(f"{task}: ATS vs none: {d['text'].split(': ', 1)[1]}")
    d = report["diagnosis"]
    used = [t["name"] for t in d["tasks"] if t["above_chance"]]
    line = (f"diagnosis (before training): smoothing at b = {b:g} {d['prediction']} (pooled |signed gap| "
            f"{d['current_gap']:.3f} -> {d['predicted_gap'][f'{b:g}']:.3f} predicted; suggested b = {d['suggested_b']:g})")
    if used:
        res = report["results"]
        n = sum(res[t]["SFT b=0"]["n"] for t in used)
        measured = sum((abs(res[t][b_key]["signed_gap"]) - abs(res[t]["SFT b=0"]["signed_gap"])) * res[t]["SFT b=0"]["n"]
                       for t in used) / n
        line += f"; measured after SFT on the same tasks: {measured:+.3f} (b = {b:g} minus b = 0)"
    lines.append(line)
    # the demo's two fine-tunings are a probe: the rule of `hf-lsce diagnose --probe` on their paired ECE changes
    from .diagnosis import probe_rule
    from .sweep import verdicts

    per_task = {t: {"ece": x} for t, items in report["what_moved"].items() for x in items
                if x["from"] == "SFT b=0" and x["to"] == b_key and x["metric"] == "ece"}
    if per_task:
        verdict = verdicts({b_key: per_task})[b_key]
        res = report["results"]
        n = sum(res[t]["SFT b=0"]["n"] for t in per_task)
        pooled = [sum(res[t][k]["ece"] * res[t]["SFT b=0"]["n"] for t in per_task) / n for k in ("SFT b=0", b_key)]
        how = f"; pooled ECE {pooled[0]:.3f} -> {pooled[1]:.3f} decides" if verdict == "mixed" else ""
        lines.append(f"measured by these two fine-tunings (hf-lsce diagnose --probe's rule): smoothing at b = {b:g} "
                     f"{probe_rule(verdict, pooled[0], pooled[1], b)} ({verdict}{how})")
    tk = report.get("tokens", {})
    if "SFT b=0" in tk and b_key in tk:
        t0, t1 = tk["SFT b=0"], tk[b_key]
        from .diagnosis import gap_verdict

        effect = gap_verdict(t0["signed_gap"], t1["signed_gap"])
        lines.append(f"next tokens of {t0['n']} held-out instruction tokens: signed gap {t0['signed_gap']:+.3f} after "
                     f"SFT at b = 0, for which the diagnosis predicts smoothing {t0['prediction'][f'{b:g}']} "
                     f"({t0['predicted_gap'][f'{b:g}']:+.3f}); measured at b = {b:g}: {t1['signed_gap']:+.3f} ({effect})")
    return lines


def format_report(report: dict) -> str:
    lines = [f"hf-lsce demo: {report['model']} on {report['device']} ({report['budget']['name']} budget, "
             f"{report['budget']['sft_steps']} SFT steps of {report['budget']['batch_size']}, "
             f"{report['seconds']:.0f} s)"]
    for task, rows in report["results"].items():
        info = report["tasks"][task]
        lines.append(f"{task} ({info['n']} items, split {info['split']}, {info['shots']}-shot):")
        lines.append(f"  {'':<26}{'acc':>7}{'ECE':>7}{'RMS':>7}{'NLL':>7}")
        for name, r in rows.items():
            lines.append(f"  {name:<26}{r['acc']:>7.3f}{r['ece']:>7.3f}{r['rms']:>7.3f}{r['nll']:>7.3f}")
    lines.append("what moved (paired bootstrap, 95% intervals over the items):")
    lines += [f"  {s}" for s in report["summary"]]
    lines.append(f"report: {os.path.join(report['output_dir'], 'report.json')}; reliability diagrams: "
                 + ", ".join(report["diagrams"].values()))
    return "\n".join(lines)
