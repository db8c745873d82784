"""``hf-lsce sweep``: choose the label-smoothing factor b from data.

Short fine-tunings of one checkpoint over a grid of b (always including 0), from the same weights, data order and
seed, through ``apply_lsce_patch`` and TRL's ``SFTTrainer`` (``CalibrationCallback`` logging ECE and the signed gap on
a watch task while each trains). Every run is then scored on the same held-out multiple-choice items; each b is
compared with b = 0 by paired bootstraps over the items (ECE, signed gap, accuracy), and each run's signed gap
(mean confidence minus accuracy) gets a 95% interval, so that under-confidence (smoothing pushing the model past
calibrated) shows as such. Each run's next-token calibration on the held-out instruction records is reported too,
with the diagnosis' state-based counterfactual for each b asked of the b = 0 run (``tokens``; not validated): the level
the loss acts on.

Verdict per b against 0: ``better`` (some task's ECE lower with its interval below 0, none higher with its interval
above 0), ``worse`` (the reverse), ``mixed`` (both), or ``no resolvable change``; a b whose accuracy interval lies
below 0 on some task is said to cost accuracy. The suggested b is the ``better`` b of lowest pooled ECE
(items-weighted over the tasks) that costs no accuracy, else 0; ``lowest_ece_b`` is the same choice ignoring
accuracy. The budgets are the demo's (``--budget``, ``--steps``,
``--limit``): short runs answer "which b, for this model and data, at this length of training", not what a long run
would reach.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
from dataclasses import asdict

import torch

from .diagnosis import decide_sweep, token_report
from .finetune import DEFAULT_DATA, DEFAULT_MODEL, choose_budget, device, prepare, sft, token_records

logger = logging.getLogger(__name__)

DEFAULT_B = (0.0, 0.05, 0.1, 0.2)
DEFAULT_TASKS = "arc_easy,sciq,mmlu"


def parse_b_values(values) -> list[float]:
    """Sorted unique b in [0, 1) with 0 added (the reference); from a list of numbers or "0,0.05,0.1"."""
    if isinstance(values, str):
        parts = [p.strip() for p in values.split(",") if p.strip()]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"b values must be numbers separated by commas (e.g. 0,0.05,0.1,0.2); got {values!r}") \
                from None
    try:
        vals = [float(v) for v in values if not isinstance(v, bool)]
    except (TypeError, ValueError):
        raise TypeError(f"b values must be numbers; got {values!r}") from None
    if len(vals) != len(list(values)) or not vals:
        raise ValueError(f"b values must be one or more numbers in [0, 1); got {values!r}")
    bad = [v for v in vals if not (math.isfinite(v) and 0 <= v < 1)]
    if bad:
        raise ValueError(f"every b must lie in [0, 1) (1 would train on the uniform distribution alone); got {bad}")
    out = sorted(set(vals) | {0.0})
    if len(out) < 2:
        raise ValueError("give at least one b > 0 to compare with b = 0 (e.g. --b 0,0.05,0.1,0.2)")
    return out


def run_sweep(output_dir: str = "hf_lsce_sweep", *, model: str = DEFAULT_MODEL, b_values=DEFAULT_B,
              dataset: str | None = None, eval_tasks: str = DEFAULT_TASKS, data_dir: str | None = None,
              budget: str = "auto", steps: int | None = None, limit=None, seed: int = 0, n_bins: int = 10) -> dict:
    """Run the sweep; returns the report (also written to ``output_dir/sweep.json``, with ``sweep.png``)."""
    from .calibration import paired_bootstrap, score_task, signed_gap_interval

    bs = parse_b_values(b_values)
    plan = choose_budget(budget, steps=steps)
    t_start = time.perf_counter()
    path, tokenizer, shots, train, held_out, tasks = prepare(model, plan, eval_tasks, limit, dataset, data_dir,
                                                             command="sweep")
    watch = tasks[0]
    from .calibration import Task

    watch = Task(name=watch.name, kind=watch.kind, items=watch.items[:20], split=watch.split)
    dev = device()
    logger.info("sweep on %s (%s budget, %s): b in %s, %d SFT steps of %d, %d SFT records, tasks %s", model,
                plan.name, dev, bs, plan.sft_steps, plan.batch_size, len(train), {t.name: len(t) for t in tasks})

    scores, runs, tokens = {}, {}, {}
    for i, b in enumerate(bs):
        key = f"{b:g}"
        logger.info("run %d of %d: fine-tuning with label smoothing %s through the fused op", i + 1, len(bs), key)
        m, info = sft(path, tokenizer, train, held_out[:32], watch, label_smoothing=b, budget=plan,
                      output_dir=os.path.join(output_dir, f"sft_b{key}"), seed=seed)
        m = m.to(dev)
        scores[key] = {}
        for t in tasks:
            logger.info("run %d of %d (b = %s): scoring %s (%d items)", i + 1, len(bs), key, t.name, len(t))
            scores[key][t.name] = score_task(m, tokenizer, t, batch_size=16, n_bins=n_bins, progress=True)
        runs[key] = info  # train_loss, seconds, the callback's history (the demo's "sft" record)
        tokens[key] = token_report(m, tokenizer, token_records(held_out, plan), bs, predict=b == 0)
        del m
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    results, comparisons, pooled = {}, {}, {}
    for key, per_task in scores.items():
        results[key] = {}
        for name, s in per_task.items():
            lo, hi = signed_gap_interval(s.probs, s.labels)
            results[key][name] = {**s.summary(), "signed_gap_lo": lo, "signed_gap_hi": hi,
                                  "state": "over-confident" if lo > 0 else "under-confident" if hi < 0 else
                                  "calibrated within its interval"}
        n = sum(r["n"] for r in results[key].values())
        pooled[key] = {m: sum(r[m] * r["n"] for r in results[key].values()) / n for m in ("ece", "rms", "signed_gap")}
        if key == "0":
            continue
        comparisons[key] = {}
        for name, s in per_task.items():
            ref = scores["0"][name]
            comparisons[key][name] = {
                metric: asdict(paired_bootstrap(ref.probs, s.probs, ref.labels, metric=metric, n_bins=n_bins,
                                                seed=seed))
                for metric in ("ece", "signed_gap", "acc")}
    report = {"output_dir": output_dir, "model": model, "checkpoint": path, "device": str(dev),
              "budget": {"name": plan.name, "sft_steps": plan.sft_steps, "batch_size": plan.batch_size, "lr": plan.lr},
              "dataset": dataset or DEFAULT_DATA, "sft_records": len(train), "seed": seed, "b_values": bs,
              "tasks": {t.name: {"n": len(t), "split": t.split, "shots": shots[t.name]} for t in tasks},
              "runs": runs, "results": results, "pooled": pooled, "versus_b0": comparisons, "tokens": tokens,
              "seconds": round(time.perf_counter() - t_start, 1)}
    decide_sweep(report)
    report["figure"] = plot_sweep(report, os.path.join(output_dir, "sweep.png"))
    with open(os.path.join(output_dir, "sweep.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def plot_sweep(report: dict, path: str) -> str:
    """Two panels over b: each task's ECE (and the pooled one), and each task's signed gap with its 95% interval
    (above 0 over-confident, below under-confident)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = report["b_values"]
    keys = [f"{b:g}" for b in bs]
    tasks = list(report["tasks"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for j, t in enumerate(tasks):
        ece = [report["results"][k][t]["ece"] for k in keys]
        gap = [report["results"][k][t]["signed_gap"] for k in keys]
        lo = [report["results"][k][t]["signed_gap_lo"] for k in keys]
        hi = [report["results"][k][t]["signed_gap_hi"] for k in keys]
        ax1.plot(bs, ece, "o-", color=f"C{j}", label=t)
        ax2.errorbar([b + 0.01 * max(bs) * (j - len(tasks) / 2) for b in bs], gap,
                     yerr=[[g - a for g, a in zip(gap, lo)], [c - g for g, c in zip(gap, hi)]], fmt="o-",
                     color=f"C{j}", capsize=3, label=t)
    ax1.plot(bs, [report["pooled"][k]["ece"] for k in keys], "k--", lw=2, label="pooled")
    ax1.axvline(report["suggested_b"], color="0.6", ls=":", label=f"suggested b = {report['suggested_b']:g}")
    ax1.set_xlabel("label smoothing b")
    ax1.set_ylabel("ECE (held-out)")
    ax1.legend(fontsize=8)
    if report.get("tokens"):
        ax2.plot(bs, [report["tokens"][k]["signed_gap"] for k in keys], "k*--", ms=9, label="next tokens")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xlabel("label smoothing b")
    ax2.set_ylabel("signed gap: confidence - accuracy")
    ax2.set_title("> 0 over-confident, < 0 under-confident", fontsize=9)
    ax2.legend(fontsize=8)
    fig.suptitle(f"{report['model']}: {report['budget']['sft_steps']} SFT steps per b, seed {report['seed']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def format_sweep(report: dict) -> str:
    keys = [f"{b:g}" for b in report["b_values"]]
    tasks = list(report["tasks"])
    lines = [f"hf-lsce sweep: {report['model']} on {report['device']} ({report['budget']['sft_steps']} SFT steps of "
             f"{report['budget']['batch_size']} per b, seed {report['seed']}, {report['seconds']:.0f} s)",
             "ECE / signed gap (confidence - accuracy) / accuracy, held-out:",
             f"  {'b':<6}" + "".join(f"{t + ' (' + str(report['tasks'][t]['n']) + ')':>26}" for t in tasks)
             + f"{'pooled ECE':>12}"]
    for k in keys:
        cells = "".join(f"{r['ece']:>9.3f} /{r['signed_gap']:>+7.3f} /{r['acc']:>6.3f}"
                        for r in (report["results"][k][t] for t in tasks))
        lines.append(f"  {k:<6}{cells}{report['pooled'][k]['ece']:>12.3f}")
    lines.append("against b = 0 (paired bootstrap over the items, 95% intervals):")
    for k, per_task in report["versus_b0"].items():
        parts = []
        for t, c in per_task.items():
            e = c["ece"]
            parts.append(f"{t} ECE {e['diff']:+.3f} [{e['low']:+.3f}, {e['high']:+.3f}]")
        cost = [f"{t} {per_task[t]['acc']['diff']:+.3f} [{per_task[t]['acc']['low']:+.3f}, "
                f"{per_task[t]['acc']['high']:+.3f}]" for t in report["accuracy_cost"][k]]
        lines.append(f"  b = {k}: {report['verdict'][k]}; " + "; ".join(parts)
                     + (f"; accuracy lower on {', '.join(cost)}" if cost else ""))
    if report.get("tokens"):
        tk = report["tokens"]
        lines.append(f"next-token signed gap on {tk['0']['n']} held-out instruction tokens: "
                     + ", ".join(f"b = {k} {tk[k]['signed_gap']:+.3f}" for k in keys)
                     + "; the counterfactual (not validated) of the b = 0 run said: "
                     + ", ".join(f"b = {k} {tk['0']['prediction'][k]}" for k in keys if k != "0"))
    under = [f"{t} at b = {k}" for k in keys for t in tasks
             if report["results"][k][t]["state"] == "under-confident"]
    if under:
        lines.append("under-confident (signed gap's interval below 0): " + ", ".join(under))
    why = ""
    if not report["suggested_b"]:
        worse = [k for k, v in report["verdict"].items() if v in ("worse", "mixed")]
        if report["lowest_ece_b"]:
            why = f" (b = {report['lowest_ece_b']:g} lowered ECE most but cost accuracy)"
        elif worse:
            why = (" (no b > 0 lowered ECE without raising it on another task: "
                   + ", ".join(f"b = {k} {report['verdict'][k]}" for k in report["verdict"]) + ")")
        else:
            why = " (no b > 0 lowered ECE by more than these items can resolve)"
    lines.append(f"suggested b = {report['suggested_b']:g}{why}")
    lines.append(f"report: {os.path.join(report['output_dir'], 'sweep.json')}; figure: {report['figure']}")
    return "\n".join(lines)
