"""How calibrated is a model? Accuracy, ECE, RMS and reliability diagrams on MMLU, HellaSwag and ARC.

    python examples/evaluate_calibration.py --model runs/sft_label_smoothing --tasks mmlu,arc_easy,hellaswag \
        --data-dir ../shared/data --limit 500

Compare two checkpoints (say, smoothing 0 and 0.1) by running it once for each. `--tiny` scores a small
random Llama offline (its tokenizer trained on the task text) to show the mechanics in seconds.
The same thing from the shell: `hf-lsce eval --model M --tasks ...`.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_DATA = os.path.join(HERE, "..", "..", "shared", "data")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local folder or hub name of a causal LM (or an ATS head folder)")
    p.add_argument("--tasks", default="mmlu,arc_easy,arc_challenge,hellaswag")
    p.add_argument("--data-dir", default=LOCAL_DATA if os.path.isdir(LOCAL_DATA) else None,
                   help="local task files (default: ../shared/data if present, else the hub)")
    p.add_argument("--shots", type=int, default=5, help="MMLU shots")
    p.add_argument("--limit", type=int, default=500, help="questions per task (MMLU: round-robin over subjects)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-bins", type=int, default=15)
    p.add_argument("--output-dir", default="runs/calibration_eval")
    p.add_argument("--tiny", action="store_true", help="offline: a small random Llama, 40 questions per task")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from hf_lsce.calibration import evaluate_calibration, reliability_diagram, resolve_tasks

    if args.tiny:
        from hf_lsce.synthetic import small_llama
        from hf_lsce.tokenizer import train_bpe_tokenizer

        args.limit, args.shots = min(args.limit, 40), 1
        tasks = resolve_tasks(args.tasks, args.data_dir, shots=args.shots, limit=args.limit)
        texts = [it.context + c for t in tasks for it in t.items for c in it.choices]
        texts += [f"Answer: {letter}" for letter in "ABCDE"] * 50  # MMLU answers are single letter tokens
        tokenizer = train_bpe_tokenizer(texts, vocab_size=1024, model_max_length=1024)
        torch.manual_seed(0)
        model = small_llama(tokenizer, hidden=64, layers=2, max_positions=1024).eval()
    else:
        if args.model is None:
            raise SystemExit("--model is required (or --tiny)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
        model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        tasks = resolve_tasks(args.tasks, args.data_dir, shots=args.shots, limit=args.limit)
    results = evaluate_calibration(model, tokenizer, tasks, batch_size=args.batch_size, n_bins=args.n_bins)
    os.makedirs(args.output_dir, exist_ok=True)
    print(f"{'task':<15}{'n':>6}{'acc':>8}{'conf':>8}{'ECE':>8}{'RMS':>8}{'NLL':>8}")
    summary = {}
    for name, scores in results.items():
        s = summary[name] = scores.summary()
        reliability_diagram(scores.metrics, os.path.join(args.output_dir, f"{name}.png"), title=name)
        print(f"{name:<15}{len(scores.labels):>6}{s['acc']:>8.3f}{s['mean_confidence']:>8.3f}{s['ece']:>8.3f}"
              f"{s['rms']:>8.3f}{s['nll']:>8.3f}")
    with open(os.path.join(args.output_dir, "calibration.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"reliability diagrams and calibration.json in {args.output_dir}")
    return summary


if __name__ == "__main__":
    main()
