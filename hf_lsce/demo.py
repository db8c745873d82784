"""``hf-lsce demo``: the whole story on a real checkpoint and real data, offline.

1. The base model (default SmolLM2-135M-Instruct, installed from the package registry) is scored on real
   ARC-Easy, SciQ, PIQA and MMLU items (the installed hub-schema data, or ``--data-dir`` files):
   accuracy, ECE, RMS, NLL.
2. ``hf-lsce diagnose`` on this model (:mod:`hf_lsce.diagnosis`): its signed calibration gap per task and on
   held-out instruction tokens, and the state-based counterfactual of smoothing at b (no prediction: the two
   fine-tunings below are the measurement, read with the probe's rule).
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
from dataclasses import asdict

import torch

from .finetune import DEFAULT_DATA, DEFAULT_MODEL, choose_budget, device, prepare, sft, token_records

logger = logging.getLogger(__name__)

DEFAULT_TASKS = "arc_easy,sciq,piqa,mmlu"  # three where small models are above chance, and the paper's MMLU


def run_demo(output_dir: str = "hf_lsce_demo", *, model: str = DEFAULT_MODEL, dataset: str | None = None,
             eval_tasks: str = DEFAULT_TASKS, data_dir: str | None = None, label_smoothing: float = 0.1,
             budget: str = "auto", steps: int | None = None, ats_steps: int | None = None, limit=None,
             seed: int = 0) -> dict:
    """Run the demo; returns the report (also written to ``output_dir/report.json``)."""
    from .ats import ATSCalibrator
    from .ats.training import train_ats
    from .calibration import Task, paired_bootstrap, reliability_grid, score_task
    from .calibration.scoring import at_temperature
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not 0 < label_smoothing <= 1:
        raise ValueError(f"label_smoothing must lie in (0, 1]; got {label_smoothing!r} (the demo compares it to 0)")
    plan = choose_budget(budget, steps=steps, ats_steps=ats_steps)
    t_start = time.perf_counter()

    # -------------------------------------------------------------------------- model and data
    from transformers import AutoModelForCausalLM

    path, tokenizer, shots, train, calib, tasks = prepare(model, plan, eval_tasks, limit, dataset, data_dir)
    dev = device()
    logger.info("demo on %s (%s budget, %s): %d SFT records, %d calibration records, tasks %s", model, plan.name, dev,
                len(train), len(calib), {t.name: len(t) for t in tasks})

    def score_all(m, label, temperatures=()):
        out = {}
        for t in tasks:
            logger.info("scoring %s on %s (%d items)", label, t.name, len(t))
            out[t.name] = score_task(m, tokenizer, t, batch_size=16, n_bins=10, progress=True,
                                     temperatures=temperatures)
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

    runs, trained, tokens = {}, {}, {}

    def fit(key, head, loss, lr, base0):
        logger.info("fitting %s on %d held-out records", key, len(calib))
        cal = ATSCalibrator.from_base(base0, head_type=head, loss_type=loss)
        kw = {"bf16": True} if plan.bf16 and dev.type == "cuda" else {}
        return train_ats(base0, tokenizer, calib, calibrator=cal, max_steps=plan.ats_steps, learning_rate=lr,
                         per_device_train_batch_size=plan.batch_size, max_length=plan.max_length,
                         output_dir=os.path.join(output_dir, "ats" if head == "transformer" else "temperature"),
                         save_steps=max(plan.ats_steps, 1), logging_steps=max(1, plan.ats_steps // 5), seed=seed,
                         **kw)

    watch = next((t for t in tasks if t.name == "arc_easy"), tasks[0])  # logged during training: a cheap task
    watch = Task(name=watch.name, kind=watch.kind, items=watch.items[:20], split=watch.split)
    for b in (0.0, label_smoothing):
        key = f"SFT b={b:g}"
        logger.info("fine-tuning with label smoothing %g through the fused op", b)
        m, info = sft(path, tokenizer, train, calib[:32], watch, label_smoothing=b, budget=plan,
                      output_dir=os.path.join(output_dir, f"sft_b{b:g}"), seed=seed)
        trained[key], runs[key] = m.to(dev), info
        if b == 0.0:
            # 4a. temperature scaling fitted on it now: one temperature for every token, so its row is this model's
            # scoring at that temperature, taken in the same forward passes (no second pass over the items)
            for p in m.parameters():
                p.requires_grad_(False)
            cal = fit("SFT b=0 + temperature", "scalar", "nll", 5e-2, m)
            with torch.no_grad():  # (the scalar head's one inverse temperature, as its forward clamps it)
                temperature = 1.0 / float(cal.inverse_temperature(torch.zeros(1, 1, 1, device=dev)))
            scores[key] = score_all(m, key, temperatures=(temperature,))
            scores["SFT b=0 + temperature"] = {t.name: at_temperature(scores[key][t.name], t, temperature, n_bins=10)
                                               for t in tasks}
        else:
            scores[key] = score_all(trained[key], key)
        tokens[key] = token_report(trained[key], tokenizer, tok_records, (label_smoothing,), predict=b == 0.0)
        if b != 0.0:
            del trained[key]
            gc.collect()

    # -------------------------------------------------------------------------- 4b: ATS
    key = "SFT b=0 + ATS"
    scores[key] = score_all(fit(key, "transformer", "selective", 5e-4, trained["SFT b=0"]), key)
    scores["SFT b=0 + temperature"] = scores.pop("SFT b=0 + temperature")  # (the table's order: ATS, then it)

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
              "diagnosis": diagnosis, "sft": runs, "tokens": tokens, "results": results, "what_moved": moved, "diagrams": diagrams,
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
    line = (f"diagnosis (before training): no prediction without a probe; the state-based counterfactual (not "
            f"validated) said {d['state_prediction']} at b = {b:g} (pooled |signed gap| {d['current_gap']:.3f} -> "
            f"{d['predicted_gap'][f'{b:g}']:.3f})")
    if used:
        res = report["results"]
        n = sum(res[t]["SFT b=0"]["n"] for t in used)
        measured = sum((abs(res[t][b_key]["signed_gap"]) - abs(res[t]["SFT b=0"]["signed_gap"])) * res[t]["SFT b=0"]["n"]
                       for t in used) / n
        line += f"; measured after SFT on the same tasks: {measured:+.3f} (b = {b:g} minus b = 0)"
    lines.append(line)
    # the demo's two fine-tunings are a probe: the rule of `hf-lsce diagnose --probe` on their paired ECE changes
    from .diagnosis import probe_rule, verdicts

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
                     f"SFT at b = 0, for which the counterfactual (not validated) said {t0['prediction'][f'{b:g}']} "
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
