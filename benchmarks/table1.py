"""The paper's Table 1 in miniature on real checkpoints, and ATS on a real instruct model (one GPU).

Table 1 ("Calibrated Language Models and How to Find Them with Label Smoothing", Lu, Huang, Zeng 2025): full
SFT of base models on instruction data with label smoothing b = 0 and b = 0.1, then accuracy, ECE and RMS,
all 5-shot. Here: Gemma-3-270m (base) and SmolLM2-135M-Instruct, real weights; SFT through ``apply_lsce_patch``
with the Trainer's ``label_smoothing_factor`` (bf16), one epoch, AdamW, linear decay; the package's scoring on
ARC-Easy, SciQ, PIQA, BoolQ and OpenBookQA (where these models are above chance) and MMLU (the paper's row),
with the signed gap, paired bootstraps against b = 0, the next-token state of every trained model on held-out
instructions, and ``hf-lsce diagnose``'s prediction for each base model beside the outcome. Runs go in
priority order until ``--deadline-s`` (see ``plan``); each is written as it comes (``table1.json``, the choice
probabilities in ``table1_probs.pt``), then ``table1.md``, ``table1.png`` and reliability diagrams
(``--report-only`` rebuilds them without a GPU).

ATS (``--ats``; "Calibrating Language Models with Adaptive Temperature Scaling", Xie et al. 2024): on
SmolLM2-135M-Instruct, an ATSCalibrator (transformer head, selective smoothing loss) and scalar temperature
scaling (NLL) fitted on instruction data that excludes the evaluation sets (Alpaca, SciQ, OpenBookQA), against
no calibration, on MMLU (letters), TruthfulQA MC1 and TriviaQA (free-form: the base's greedy answer, correct
when its normalised text equals one of the normalised aliases, confidence = the answer's probability under
each model; ATS never changes the greedy answer).

    python benchmarks/table1.py --models gemma-3-270m,smollm2-135m-instruct --data-dir ../shared/data --out-dir r
    python benchmarks/table1.py --ats --out-dir r
    python benchmarks/table1.py --smoke --out-dir /tmp/t1   (CPU, a tiny model: the code path)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import string
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SHARED = os.environ.get("HF_LSCE_SHARED_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data"))
TASKS = ("arc_easy", "sciq", "piqa", "boolq", "openbookqa", "mmlu")  # above chance for these models, then MMLU
HELD_OUT = 64  # the last records of the QA instruction sets: token-level state, never trained on


# ------------------------------------------------------------------------------------------------ data
def instruction_data(name: str, limit: int | None = None) -> list[dict]:
    from hf_lsce.data import load_instruction_records

    if name == "alpaca":
        return load_instruction_records(os.path.join(SHARED, "alpaca", "alpaca_en_demo.json"), limit)
    if name == "qa":  # real QA sets as instructions, disjoint from the evaluation tasks
        return load_instruction_records("trivia_qa,nq_open")[:-HELD_OUT][:limit]
    if name == "ats":  # for the calibrators: no TriviaQA (an ATS evaluation set)
        return load_instruction_records(os.path.join(SHARED, "alpaca", "alpaca_en_demo.json")) + \
            load_instruction_records("sciq,openbookqa")
    raise ValueError(f"unknown instruction data {name!r}")


def held_out_records():
    from hf_lsce.data import load_instruction_records

    return load_instruction_records("trivia_qa,nq_open")[-HELD_OUT:]


def eval_tasks(limits: dict, shots: int):
    from hf_lsce.calibration.tasks import resolve_tasks

    # the installed hub-schema data (or $HF_LSCE_HUB_DATA): it holds every task, ../shared/data only some
    return resolve_tasks(list(limits), None, shots=shots, limit={k: v for k, v in limits.items() if v})


# ------------------------------------------------------------------------------------------------ SFT
def sft(path, records, b, lr, seed, out_dir, epochs=1.0, batch=16, max_length=512, max_steps=-1):
    """Full SFT through the patch; returns the trained model (eval mode) and the Trainer's log."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import SFTConfig, SFTTrainer

    from hf_lsce import apply_lsce_patch

    set_seed(seed)
    cuda = torch.cuda.is_available()
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = apply_lsce_patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    args = SFTConfig(output_dir=out_dir, num_train_epochs=epochs, max_steps=max_steps, per_device_train_batch_size=batch,
                     learning_rate=lr, lr_scheduler_type="linear", warmup_steps=0.03, weight_decay=0.0,
                     label_smoothing_factor=b, bf16=cuda, use_cpu=not cuda, report_to=[], save_strategy="no",
                     logging_steps=10, seed=seed, max_length=max_length, completion_only_loss=True, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tok)
    trainer.train()
    return trainer.model.eval(), tok, trainer.state.log_history


def evaluate(model, tok, tasks, batch_size=32):
    from hf_lsce.calibration import score_task

    out = {}
    for t in tasks:
        s = score_task(model, tok, t, batch_size=batch_size, n_bins=15, progress=False)
        out[t.name] = {**s.summary(), "split": t.split}
        out[t.name]["_probs"], out[t.name]["_labels"] = s.probs, s.labels
    return out


def _public(res):
    return {t: {k: v for k, v in r.items() if not k.startswith("_")} for t, r in res.items()}


def diagnosis(model, tok, tasks, b=0.1) -> dict:
    """``hf-lsce diagnose`` of the base model (its state and counterfactual), on the table's own evaluation items."""
    from hf_lsce.diagnosis import diagnose_model

    return diagnose_model(model, tok, label_smoothing=b, tasks=tasks, records=held_out_records(), n_records=HELD_OUT,
                          progress=False, batch_size=32).to_dict()


def token_state(model, tok, b=0.1) -> dict:
    """The trained model's next-token state on the held-out records: signed gap and fitted temperature (the
    diagnosis predicts the ratio of the latter between b and 0), and the diagnosis' next-token prediction for
    smoothing this model at ``b``."""
    from hf_lsce.diagnosis import token_level, token_statistics
    from hf_lsce.patching.models import text_config

    st = token_statistics(model, tok, held_out_records(), progress=False)
    t, temps, _ = token_level(st, b, (b,), int(text_config(model).vocab_size))
    # prediction: what `hf-lsce diagnose` says of smoothing this model at b on these records (token_prediction)
    return {"accuracy": t["accuracy"], "mean_confidence": t["mean_confidence"], "signed_gap": t["signed_gap"],
            "ece": t["ece"], "temperature": temps["0"], "predicted_gap": t["predicted_gap"][f"{b:g}"],
            "prediction": t["prediction"]}


def probs_key(model, dataset, b, lr, seed) -> str:
    """A run's key in table1_probs.pt (the base model's: b, lr and seed None)."""
    return f"{model}|{dataset}|{b}|{lr}|{seed}"


def plan(models, datasets, seeds, lrs, smoothing, sweep):
    """Runs in priority order: (model, dataset, b, lr, seed) or (model, "base"): the bases (and their diagnosis),
    b in {0, 0.1} at the first lr and seed, the other seeds, the other learning rates, the second instruction set
    (all seeds), the sweep over b, then the other learning rates' other seeds (seed by seed, so every learning rate
    reaches two seeds before any reaches three)."""
    runs = [(m, "base", None, None, None) for m in models]
    runs += [(m, datasets[0], b, lrs[0], seeds[0]) for m in models for b in smoothing]
    runs += [(m, datasets[0], b, lrs[0], s) for s in seeds[1:] for m in models for b in smoothing]
    runs += [(m, datasets[0], b, lr, seeds[0]) for lr in lrs[1:] for m in models for b in smoothing]
    runs += [(m, d, b, lrs[0], s) for d in datasets[1:] for s in seeds for m in models for b in smoothing]
    runs += [(m, datasets[0], b, lrs[0], seeds[0]) for m in models for b in sweep]
    runs += [(m, datasets[0], b, lr, s) for s in seeds[1:] for lr in lrs[1:] for m in models for b in smoothing]
    return runs


def run_table(args):
    from hf_lsce.calibration import paired_bootstrap
    from hf_lsce.checkpoints import resolve_model_path

    start = time.time()
    out_path = os.path.join(args.out_dir, "table1.json")
    results = json.load(open(out_path)) if os.path.exists(out_path) and args.resume else {"runs": [], "diagnosis": {}}
    done = {(r["model"], r["dataset"], r["b"], r["lr"], r["seed"]) for r in results["runs"]}
    results["not_run"] = []
    tasks = eval_tasks({t: args.limits.get(t) for t in TASKS}, args.shots)
    probs_path = os.path.join(args.out_dir, "table1_probs.pt")
    probs = torch.load(probs_path) if os.path.exists(probs_path) and args.resume else {}
    paths = {m: resolve_model_path(m) for m in args.models}
    records = {d: instruction_data(d, args.records) for d in args.datasets}
    for model_name, dataset, b, lr, seed in plan(args.models, args.datasets, args.seeds, args.lrs, args.smoothing,
                                                 args.sweep):
        if (model_name, dataset, b, lr, seed) in done:
            continue
        # a run is started only if it can end before the deadline: its expected length is the longest earlier run
        # of the same model and data (resumed ones included;
        # of the same data when this model has none), so a call is not killed in the middle of one
        same = [r["seconds"] for r in results["runs"] if r["dataset"] == dataset]
        expected = max([r["seconds"] for r in results["runs"] if (r["model"], r["dataset"]) == (model_name, dataset)]
                       or same or [0.0])
        if args.deadline_s is not None and time.time() - start + expected > args.deadline_s:
            print(f"deadline: not run: {model_name} {dataset} b={b} lr={lr} seed={seed}", flush=True)
            results.setdefault("not_run", []).append([model_name, dataset, b, lr, seed])
            continue
        t0 = time.time()
        if dataset == "base":
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(paths[model_name])
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            model = AutoModelForCausalLM.from_pretrained(paths[model_name], dtype=torch.float32)
            model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
            results["diagnosis"][model_name] = diagnosis(model, tok, tasks)
            log = []
        else:
            model, tok, log = sft(paths[model_name], records[dataset], b, lr, seed,
                                  os.path.join(args.out_dir, "sft_tmp"), max_steps=args.max_steps, batch=args.batch)
        res = evaluate(model, tok, tasks)
        probs[probs_key(model_name, dataset, b, lr, seed)] = {t: (r["_probs"], r["_labels"]) for t, r in res.items()}
        torch.save(probs, probs_path)
        row = dict(model=model_name, dataset=dataset, b=b, lr=lr, seed=seed, results=_public(res),
                   tokens=token_state(model, tok), train_loss=[h["loss"] for h in log if "loss" in h],
                   seconds=round(time.time() - t0, 1))
        if b:  # the paired change against b = 0 with the same seed, lr and data (items resampled jointly)
            ref = probs.get(probs_key(model_name, dataset, 0.0, lr, seed))
            if ref is not None:
                row["vs_b0"] = {t: {m: paired_bootstrap(ref[t][0], res[t]["_probs"], res[t]["_labels"],
                                                        metric=m, n_boot=500).__dict__
                                    for m in ("ece", "rms", "acc", "signed_gap")} for t in res}
        results["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "vs_b0"}), flush=True)
        _write(out_path, results)
        del model
        _release()
    report(results, args.out_dir)
    return results


def report(results, out_dir, probs=None) -> str:
    """table1.md, table1.png and the reliability diagrams (b = 0 against b = 0.1, first data, lr and seed) from
    table1.json and table1_probs.pt: rebuilt without a GPU (``--report-only``)."""
    probs_path = os.path.join(out_dir, "table1_probs.pt")
    if probs is None and os.path.exists(probs_path):
        probs = torch.load(probs_path)
    md = table_markdown(results) + ("\n" + "\n".join(prior_table(results["runs"], probs)) if probs else "")
    with open(os.path.join(out_dir, "table1.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    plot_table(results, os.path.join(out_dir, "table1.png"))
    if probs:
        reliability_pictures(results, probs, out_dir)
    return md


# The tasks answered from one fixed answer set, and that set in option order (calibration.tasks: BoolQ's choices are
# [" no", " yes"], MMLU's the letters)
ANSWER_SETS = {"boolq": ("no", "yes"), "mmlu": ("A", "B", "C", "D")}


def answer_prior(p: torch.Tensor, labels: torch.Tensor, answers) -> dict:
    """The answer prior of one run on one fixed-answer task: the answer the model gives most (argmax over the
    options), the share of items on which it gives it, the share of items whose gold answer it is, and accuracy."""
    from hf_lsce.diagnosis import answer_lean

    top, share = answer_lean(p)
    return {"answer": answers[top], "share": share, "gold_share": float((labels == top).float().mean()),
            "acc": float((p.argmax(-1) == labels).float().mean())}


def prior_table(runs, probs) -> list:
    """Per (model, data, lr) with paired b = 0 and 0.1 runs: on BoolQ and MMLU, each seed's most given answer and its
    share at b = 0 and at b = 0.1 (what moved on the single-token tasks: the answer prior, not only the spread)."""
    present = [t for t in ANSWER_SETS if any(t in v for v in probs.values())]
    if not present:
        return []
    lines = ["", "The answer prior on the fixed-answer tasks: each paired seed's most given answer and the share of items "
             "it is given on, b = 0 -> b = 0.1 (gold: the share of items whose right answer each of those answers is):", "",
             "| model | SFT data | lr | seeds | " + " | ".join(present) + " |", "|---|---|---|---|" + "---|" * len(present)]
    groups = {}
    for r1 in runs:
        if r1["b"] != 0.1:
            continue
        k0, k1 = (probs_key(r1["model"], r1["dataset"], b, r1["lr"], r1["seed"]) for b in (0.0, 0.1))
        if k0 in probs and k1 in probs:
            groups.setdefault((r1["model"], r1["dataset"], r1["lr"]), []).append((probs[k0], probs[k1]))
    for (model, dataset, lr), pairs in groups.items():
        cells = []
        for t in present:
            seeds, gold = [], {}
            for p0, p1 in pairs:
                if t not in p0 or t not in p1:
                    continue
                a0, a1 = (answer_prior(*p[t], ANSWER_SETS[t]) for p in (p0, p1))
                gold.update({a["answer"]: a["gold_share"] for a in (a0, a1)})
                seeds.append(f"{a0['answer']} {a0['share']:.2f} -> {a1['answer']} {a1['share']:.2f}")
            golds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(gold.items()))
            cells.append("; ".join(seeds) + f" (gold: {golds})" if seeds else "-")
        lines.append(f"| {os.path.basename(model)} | {dataset} | {lr} | {len(pairs)} | " + " | ".join(cells) + " |")
    return lines


def reliability_pictures(results, probs, out_dir) -> None:
    """One PNG per model: for each task (rows) the reliability diagrams of SFT b = 0 and b = 0.1 (seed 0)."""
    from matplotlib.figure import Figure

    from hf_lsce.calibration import calibration_metrics
    from hf_lsce.calibration.plots import reliability_diagram

    runs = [r for r in results["runs"] if r["dataset"] != "base"]
    if not runs:
        return
    first = (runs[0]["dataset"], runs[0]["lr"], runs[0]["seed"])
    for model in dict.fromkeys(r["model"] for r in runs):
        keys = [probs_key(model, first[0], b, first[1], first[2]) for b in (0.0, 0.1)]
        if not all(k in probs for k in keys):
            continue
        tasks = list(probs[keys[0]])
        fig = Figure(figsize=(3.3 * len(tasks), 6.4))
        axes = fig.subplots(2, len(tasks), squeeze=False)
        for j, t in enumerate(tasks):
            for i, (k, b) in enumerate(zip(keys, (0.0, 0.1))):
                p, y = probs[k][t]
                res = calibration_metrics(p, y, n_bins=10)
                reliability_diagram(res, ax=axes[i][j], title=f"{t}, b = {b:g}: gap {res.signed_gap:+.3f}")
                if i or j:
                    axes[i][j].get_legend().remove()
        fig.suptitle(f"{os.path.basename(model)}: SFT on {first[0]} (lr {first[1]:g}, seed {first[2]})")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"table1_reliability_{_slug(model)}.png"), dpi=100)


def _slug(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", os.path.basename(model).split(".")[0]).strip("_").lower()


def plot_table(results, path) -> None:
    """ECE and accuracy against b per model and task (first dataset and lr; mean and spread over seeds; the base
    model as a dashed line)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = [r for r in results["runs"] if r["dataset"] != "base"]
    if not runs:
        return
    first = (runs[0]["dataset"], runs[0]["lr"])
    models = list(dict.fromkeys(r["model"] for r in results["runs"]))
    tasks = list(runs[0]["results"])
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 6.5), squeeze=False)
    for mi, model in enumerate(models):
        base = next((r for r in results["runs"] if r["model"] == model and r["dataset"] == "base"), None)
        mine = [r for r in runs if r["model"] == model and (r["dataset"], r["lr"]) == first]
        bs = sorted({r["b"] for r in mine})
        for ti, task in enumerate(tasks):
            for row, metric in enumerate(("ece", "acc")):
                ax = axes[row][ti]
                vals = [[r["results"][task][metric] for r in mine if r["b"] == b] for b in bs]
                mean = [sum(v) / len(v) for v in vals]
                std = [(sum((x - m) ** 2 for x in v) / max(len(v) - 1, 1)) ** 0.5 for v, m in zip(vals, mean)]
                line = ax.errorbar(bs, mean, yerr=std, marker="o", capsize=3, label=os.path.basename(model))
                if base is not None:
                    ax.axhline(base["results"][task][metric], ls="--", color=line[0].get_color(), alpha=0.6)
                ax.set_title(f"{task}: {metric.upper() if metric == 'ece' else 'accuracy'}")
                ax.set_xlabel("label smoothing b")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"SFT on {first[0]} (lr {first[1]:g}); dashed: the base model; bars: std over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_sd(vals):
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((x - m) ** 2 for x in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return m, sd


def _cell(vals, fmt="{:.3f}"):
    if not vals:
        return "-"
    m, sd = _mean_sd(vals)
    return fmt.format(m) + (f" ± {sd:.3f}" if sd is not None else "")


def table_markdown(results) -> str:
    """Three tables: ECE and signed gap per task (mean ± sd over seeds) for every (model, data, lr, b); the paired
    change b = 0.1 against 0 (seeds whose 95% interval excludes 0); the diagnosis' prediction against the
    measured change on the tasks it pooled."""
    runs = results["runs"]
    tasks = [t for t in TASKS if any(t in r["results"] for r in runs)]
    groups = {}
    for r in runs:
        groups.setdefault((r["model"], r["dataset"], r["b"], r["lr"]), []).append(r)
    lines = ["ECE / signed gap (mean confidence - accuracy) / accuracy, mean ± sd over seeds:", "",
             "| model | SFT data | lr | b | seeds | " + " | ".join(tasks) + " |", "|---|---|---|---|---|" + "---|" * len(tasks)]
    for (model, dataset, b, lr), rs in groups.items():
        cells = []
        for t in tasks:
            have = [r["results"][t] for r in rs if t in r["results"]]
            cells.append(f"{_cell([h['ece'] for h in have])} / {_cell([h['signed_gap'] for h in have], '{:+.3f}')} / "
                         f"{_cell([h['acc'] for h in have])}" if have else "-")
        lines.append(f"| {os.path.basename(model)} | {dataset} | {'-' if lr is None else lr} | {'-' if b is None else b} | "
                     f"{len(rs)} | " + " | ".join(cells) + " |")
    lines += ["", "Paired change b = 0.1 minus b = 0 (same data, lr and seed; items resampled jointly): mean over seeds of "
              "the ECE change, and how many seeds' 95% intervals lie below / above 0:", "",
              "| model | SFT data | lr | seeds | " + " | ".join(tasks) + " |", "|---|---|---|---|" + "---|" * len(tasks)]
    for (model, dataset, b, lr), rs in groups.items():
        rs = [r for r in rs if "vs_b0" in r and b == 0.1]
        if not rs:
            continue
        cells = []
        for t in tasks:
            ds = [r["vs_b0"][t]["ece"] for r in rs if t in r["vs_b0"]]
            if not ds:
                cells.append("-")
                continue
            down = sum(d["high"] < 0 for d in ds)
            up = sum(d["low"] > 0 for d in ds)
            cells.append(f"{sum(d['diff'] for d in ds) / len(ds):+.3f} ({down}↓ {up}↑)")
        lines.append(f"| {os.path.basename(model)} | {dataset} | {lr} | {len(rs)} | " + " | ".join(cells) + " |")
    lines += ["", "The diagnosis (base model, before training) against what SFT measured (pooled over the tasks the "
              "diagnosis found above chance; b = 0.1 minus b = 0, mean over the paired runs of the first data and lr):", "",
              "| model | state-based counterfactual | its b | pooled abs. gap now -> predicted | measured ECE change | "
              "measured abs.-gap change | measured verdict |", "|---|---|---|---|---|---|---|"]
    for model, d in results.get("diagnosis", {}).items():
        if "state_prediction" not in d:  # (results of an earlier version kept the counterfactual as "prediction")
            d = dict(d, state_prediction=d.get("prediction"), state_suggested_b=d.get("suggested_b"))
        used = [s["name"] for s in d["tasks"] if s["above_chance"]]
        first = next((r for r in runs if r["dataset"] != "base"), None)
        pairs = [(r0, r1) for r1 in runs for r0 in runs if first and r1["model"] == model and r1["b"] == 0.1
                 and r0["model"] == model and r0["b"] == 0.0 and (r0["dataset"], r0["lr"], r0["seed"]) ==
                 (r1["dataset"], r1["lr"], r1["seed"]) and (r1["dataset"], r1["lr"]) == (first["dataset"], first["lr"])]
        if not pairs or not used:
            continue

        def pooled(r, key, absolute=False):
            n = sum(r["results"][t]["n"] for t in used)
            return sum((abs(r["results"][t][key]) if absolute else r["results"][t][key]) * r["results"][t]["n"]
                       for t in used) / n
        d_ece = sum(pooled(r1, "ece") - pooled(r0, "ece") for r0, r1 in pairs) / len(pairs)
        d_gap = sum(pooled(r1, "signed_gap", True) - pooled(r0, "signed_gap", True) for r0, r1 in pairs) / len(pairs)
        m = d["margin"]
        verdict = "helps" if d_gap < -m else "hurts" if d_gap > m else "little-effect"
        lines.append(f"| {os.path.basename(model)} | {d['state_prediction']} | {d['state_suggested_b']:g} | {d['current_gap']:.3f} -> "
                     f"{d['predicted_gap']['0.1']:.3f} | {d_ece:+.3f} | {d_gap:+.3f} | {verdict} ({len(pairs)} seeds) |")
    lines += token_table(runs)
    return "\n".join(lines)


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def _release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def token_table(runs) -> list:
    """The next-token state on the held-out instructions of every (model, data, lr) with b = 0 and b = 0.1 runs of
    the same seeds (mean over them): the signed gap and ECE at b = 0 and 0.1, and whether smoothing moved the
    |signed gap| down or up by more than 0.01 (the diagnosis' margin)."""
    from hf_lsce.diagnosis import gap_verdict

    lines = ["", "Next-token calibration on the held-out instructions (the level the loss acts on), b = 0 against "
             "b = 0.1, mean over paired seeds:", "",
             "| model | SFT data | lr | seeds | signed gap b = 0 | b = 0.1 | ECE b = 0 | b = 0.1 | effect |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups = {}  # (model, data, lr) -> its (b = 0, b = 0.1) runs of the same seed
    for r1 in runs:
        r0 = next((r for r in runs if r1["b"] == 0.1 and r["b"] == 0.0 and (r["model"], r["dataset"], r["lr"], r["seed"])
                   == (r1["model"], r1["dataset"], r1["lr"], r1["seed"])), None)
        if r0 is not None:
            groups.setdefault((r1["model"], r1["dataset"], r1["lr"]), []).append((r0, r1))
    for (model, dataset, lr), pairs in groups.items():
        def mean(i, key):
            return sum(p[i]["tokens"][key] for p in pairs) / len(pairs)
        g0, g1 = mean(0, "signed_gap"), mean(1, "signed_gap")
        effect = gap_verdict(g0, g1)
        lines.append(f"| {os.path.basename(model)} | {dataset} | {lr} | {len(pairs)} | {g0:+.3f} | "
                     f"{g1:+.3f} | {mean(0, 'ece'):.3f} | {mean(1, 'ece'):.3f} | {effect} |")
    return lines


# ------------------------------------------------------------------------------------------------ ATS
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the usual TriviaQA / SQuAD normalisation)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", s).split())


_PREFIX = re.compile(r"^(the answer is|answer)\s*:?\s*", re.IGNORECASE)


def trivia_prompt(tok, question: str) -> str:
    """The question as the model is asked it: through its chat template when it has one (instruct models),
    with a one-line instruction to answer briefly; plain ``Question: ... Answer:`` otherwise."""
    if getattr(tok, "chat_template", None):
        msg = f"Answer the trivia question with just the answer, a few words.\nQuestion: {question.strip()}"
        return tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False, add_generation_prompt=True)
    return f"Question: {question.strip()}\nAnswer:"


def extract_answer(text: str) -> str:
    """The first non-empty line of a generation, without a leading "The answer is:"."""
    line = next((x for x in text.split("\n") if x.strip()), "")
    return _PREFIX.sub("", line.strip()).strip()


def trivia_correct(answer: str, aliases: set[str]) -> bool:
    """An alias equals the normalised answer or occurs in it as whole words (lenient exact match)."""
    a = normalize_answer(answer)
    return bool(a) and any(x and (a == x or f" {x} " in f" {a} ") for x in aliases)


def answer_line_ids(tok, ids: list[int], stop: set) -> list[int]:
    """The generated tokens up to and including the one that ends the first non-empty line (or up to EOS):
    the answer as the model produced it, whose probability is its confidence."""
    out = []
    for t in ids:
        if t in stop:
            break
        out.append(t)
        text = tok.decode(out, skip_special_tokens=True).lstrip()
        if "\n" in text:
            break
    return out


@torch.no_grad()
def triviaqa_calibration(base, models: dict, tok, limit=500, max_new_tokens=24, batch=32, n_bins=15):
    """Free-form TriviaQA: the base's greedy answers (correct when an alias matches the first non-empty line);
    per model, the confidence is its probability of that generated line, token for token, and the ECE."""
    from hf_lsce.calibration import calibration_metrics
    from hf_lsce.data import load_hub_split

    rows = load_hub_split("mandarjoshi/trivia_qa", "rc.wikipedia.nocontext", "validation", local_repo="trivia_qa")
    rows = rows.select(range(min(limit, len(rows))))
    dev = next(base.parameters()).device
    prompts = [trivia_prompt(tok, r["question"]) for r in rows]
    special = not getattr(tok, "chat_template", None)  # a rendered chat template carries its own special tokens
    aliases = [set(r["answer"]["normalized_aliases"]) | {normalize_answer(r["answer"]["value"])} for r in rows]
    tok.padding_side = "left"
    stop = {tok.eos_token_id, tok.pad_token_id}
    answers, correct = [], []
    for s in range(0, len(prompts), batch):
        enc = tok(prompts[s:s + batch], return_tensors="pt", padding=True, add_special_tokens=special).to(dev)
        gen = base.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        for i, g in enumerate(gen[:, enc.input_ids.shape[1]:]):
            text = extract_answer(tok.decode(g, skip_special_tokens=True))
            answers.append(answer_line_ids(tok, g.tolist(), stop) if text else [])
            correct.append(trivia_correct(text, aliases[s + i]))
    out = {}
    for name, m in models.items():
        conf = []
        for p, a in zip(prompts, answers):
            if not a:
                conf.append(0.0)
                continue
            ctx = tok(p, add_special_tokens=special)["input_ids"]
            ids = torch.tensor([ctx + a], device=dev)
            logits = m(input_ids=ids).logits[0, len(ctx) - 1:-1].float()
            conf.append(float(torch.log_softmax(logits, -1).gather(1, torch.tensor(a, device=dev)[:, None]).sum().exp()))
        res = calibration_metrics(confidences=torch.tensor(conf), correct=torch.tensor(correct), n_bins=n_bins)
        out[name] = {"acc": res.accuracy, "ece": res.ece, "rms": res.rms, "mean_confidence": res.mean_confidence,
                     "n": res.n}
    return out


def run_ats(args):
    from hf_lsce.ats import ATSCalibrator
    from hf_lsce.ats.training import train_ats
    from hf_lsce.calibration import score_task
    from hf_lsce.calibration.tasks import load_task
    from hf_lsce.checkpoints import load_model_and_tokenizer

    start = time.time()
    base, tok = load_model_and_tokenizer(args.ats_model, dtype="fp32")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    base.eval()
    for p in base.parameters():
        p.requires_grad_(False)
    records = instruction_data("ats")[: args.records] if args.records else instruction_data("ats")
    cuda = torch.cuda.is_available()
    kw = {"bf16": True} if cuda else {}
    models = {"none": base}
    for name, head, loss, lr in (("ATS", "transformer", "selective", 5e-4), ("temperature", "scalar", "nll", 5e-2)):
        cal = ATSCalibrator.from_base(base, head_type=head, loss_type=loss)
        models[name] = train_ats(base, tok, records, calibrator=cal, max_steps=args.ats_steps, learning_rate=lr,
                                 per_device_train_batch_size=args.batch, max_length=args.max_length,
                                 output_dir=os.path.join(args.out_dir, f"ats_{name}"), save_steps=args.ats_steps,
                                 logging_steps=max(1, args.ats_steps // 5), overwrite=True, **kw)
    data_dir = SHARED if os.path.isdir(SHARED) else None
    wanted = args.ats_tasks.split(",")
    tasks = [load_task(t, data_dir, shots=args.ats_shots if t == "mmlu" else None, limit=args.limits.get(t))
             for t in ("mmlu", "truthfulqa_mc1") if t in wanted]
    report = {"model": args.ats_model, "records": len(records), "steps": args.ats_steps, "tasks": {}}
    for t in tasks:
        report["tasks"][t.name] = {}
        for name, m in models.items():
            s = score_task(m, tok, t, batch_size=32, progress=False)
            report["tasks"][t.name][name] = {k: v for k, v in s.summary().items()}
        print(t.name, json.dumps(report["tasks"][t.name]), flush=True)
    if "triviaqa" in wanted and (args.deadline_s is None or time.time() - start < args.deadline_s):
        report["tasks"]["triviaqa"] = triviaqa_calibration(base, models, tok, limit=args.trivia_limit)
        print("triviaqa", json.dumps(report["tasks"]["triviaqa"]), flush=True)
    report["seconds"] = round(time.time() - start, 1)
    with open(os.path.join(args.out_dir, "ats_real.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = ["| task | calibration | acc | ECE | RMS |", "|---|---|---|---|---|"]
    for t, rows in report["tasks"].items():
        for name, r in rows.items():
            lines.append(f"| {t} | {name} | {r['acc']:.3f} | {r['ece']:.3f} | {r['rms']:.3f} |")
    md = "\n".join(lines)
    with open(os.path.join(args.out_dir, "ats_real.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return report


def _smoke_model(out_dir):
    """A tiny Llama with a BPE tokenizer trained on the instruction data, saved as a checkpoint (CPU smoke)."""
    from hf_lsce.synthetic import small_llama
    from hf_lsce.tokenizer import train_bpe_tokenizer

    recs = instruction_data("alpaca", 200)
    tok = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in recs] + ["Answer: A B C D"] * 20,
                              vocab_size=600, model_max_length=4096)
    torch.manual_seed(0)
    model = small_llama(tok, hidden=32, layers=1, max_positions=4096)
    path = os.path.join(out_dir, "smoke_model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _limits(text):
    return {k: (int(v) if v else None) for k, v in (p.split("=") for p in text.split(","))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct")
    ap.add_argument("--datasets", default="alpaca,qa")
    ap.add_argument("--smoothing", default="0,0.1")
    ap.add_argument("--sweep", default="0.2,0.3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lrs", default="2e-5,5e-6,5e-5,2e-4", help="the paper's four; the first is the main one")
    ap.add_argument("--limits", default="arc_easy=400,sciq=400,piqa=400,boolq=400,openbookqa=400,mmlu=400")
    ap.add_argument("--shots", type=int, default=5)
    ap.add_argument("--records", type=int, default=None, help="instruction records used (default: all)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--ats", action="store_true", help="the ATS experiment instead of the table")
    ap.add_argument("--ats-model", default="smollm2-135m-instruct")
    ap.add_argument("--ats-steps", type=int, default=300)
    ap.add_argument("--ats-shots", type=int, default=5)
    ap.add_argument("--trivia-limit", type=int, default=500)
    ap.add_argument("--ats-tasks", default="mmlu,truthfulqa_mc1,triviaqa", help="the ATS experiment's evaluations")
    ap.add_argument("--max-length", type=int, default=512, help="ATS training sequence length")
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--resume", action="store_true", help="keep the runs already in table1.json")
    ap.add_argument("--out", "--out-dir", dest="out_dir", default="table1_out")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, two steps, a few items")
    ap.add_argument("--report-only", action="store_true", help="rebuild the tables and pictures from --out-dir")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    args.smoothing = [float(x) for x in args.smoothing.split(",")]
    args.sweep = [float(x) for x in args.sweep.split(",") if x]
    args.seeds = [int(x) for x in args.seeds.split(",")]
    args.lrs = [float(x) for x in args.lrs.split(",")]
    args.datasets = args.datasets.split(",")
    args.limits = _limits(args.limits)
    if args.smoke:
        path = _smoke_model(args.out_dir)
        args.models, args.seeds, args.lrs, args.sweep, args.datasets = [path], [0], [1e-3], [], ["alpaca"]
        args.limits, args.records, args.max_steps, args.batch, args.shots = (
            {t: 4 for t in TASKS + ("truthfulqa_mc1",)}, 24, 2, 4, 1)
        args.ats_model, args.ats_steps, args.trivia_limit, args.ats_shots = path, 2, 4, 1
    else:
        args.models = args.models.split(",")
    if args.report_only:
        return report(json.load(open(os.path.join(args.out_dir, "table1.json"))), args.out_dir)
    if args.ats:
        return run_ats(args)
    return run_table(args)


if __name__ == "__main__":
    main()
