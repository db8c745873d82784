"""Adaptive temperature scaling: fit a per-token temperature head on a frozen LM, then measure it.

The ATS head reads the frozen model's hidden states and predicts an inverse temperature for every
token; it is trained with the selective smoothing loss (through the fused op: no N x V logits), and
leaves every argmax unchanged. This script fits it and prints next-token calibration on held-out
responses, before and after.

    python examples/train_ats.py --model runs/sft_label_smoothing --data ../shared/data/alpaca/alpaca_en_demo.json \
        --head transformer --max-steps 500 --output-dir runs/ats_head

`--tiny` runs offline in under a minute on the demo's synthetic facts task (`hf_lsce.demo`): a small
random Llama is fine-tuned on the facts of "known" people until it overfits, then the head is fitted
and measured on other people's facts.
The same from the shell: `hf-lsce train-ats --model M --data FILE`.
"""
from __future__ import annotations

import argparse
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_ALPACA = os.path.join(HERE, "..", "..", "shared", "data", "alpaca", "alpaca_en_demo.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the frozen base: local folder or hub name")
    p.add_argument("--data", default=LOCAL_ALPACA if os.path.exists(LOCAL_ALPACA) else "tatsu-lab/alpaca")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--head", choices=["transformer", "mlp", "linear", "scalar"], default="transformer")
    p.add_argument("--max-steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--output-dir", default="runs/ats_head")
    p.add_argument("--tiny", action="store_true")
    return p.parse_args(argv)


def tiny_base(records, all_records, steps: int = 200):
    """A small Llama fine-tuned on ``records`` (plain cross-entropy), with a tokenizer trained on ``all_records``."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_lsce.synthetic import small_llama
    from hf_lsce.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer((r["prompt"] + r["completion"] for r in all_records), vocab_size=1024,
                                    model_max_length=512)
    torch.manual_seed(0)
    model = small_llama(tokenizer, hidden=64, layers=2)
    args = SFTConfig(output_dir="runs/_tiny_base", max_steps=steps, learning_rate=3e-3, per_device_train_batch_size=16,
                     max_length=128, save_strategy="no", report_to="none", use_cpu=True, bf16=False, logging_steps=steps,
                     disable_tqdm=True)
    SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer).train()
    return model.eval(), tokenizer


def main(argv=None) -> dict:
    args = parse_args(argv)
    from hf_lsce.ats.training import load_instruction_records, token_calibration, train_ats

    if args.tiny:
        args.max_steps, args.max_length, args.lr = 60, 128, 2e-3
        from hf_lsce.synthetic import make_synthetic_facts

        facts = make_synthetic_facts()
        calib = facts.calibration[::2] + facts.calibration[1::2]  # interleave known and unknown people
        half = len(calib) // 2
        fit, test = calib[:half], calib[half:]
        base, tokenizer = tiny_base(facts.train, facts.train + facts.calibration)
    else:
        records = load_instruction_records(args.data, args.limit)
        n_test = max(1, len(records) // 5)
        fit, test = records[:-n_test], records[-n_test:]
        if args.model is None:
            raise SystemExit("--model is required (or --tiny)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
        base = base.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    for p in base.parameters():
        p.requires_grad_(False)

    before = token_calibration(base, tokenizer, test, max_length=args.max_length)
    cal = train_ats(base, tokenizer, fit, output_dir=args.output_dir, head_type=args.head, max_steps=args.max_steps,
                    learning_rate=args.lr, per_device_train_batch_size=args.batch_size, max_length=args.max_length,
                    save_steps=max(args.max_steps, 1), logging_steps=max(1, args.max_steps // 5))
    after = token_calibration(cal, tokenizer, test, max_length=args.max_length)
    print(f"next-token calibration on {len(test)} held-out responses ({int(before.n)} tokens):")
    print(f"{'':<10}{'acc':>8}{'conf':>8}{'ECE':>8}{'RMS':>8}")
    for name, r in (("base", before), ("+ ATS", after)):
        print(f"{name:<10}{r.accuracy:>8.3f}{r.mean_confidence:>8.3f}{r.ece:>8.3f}{r.rms:>8.3f}")
    print(f"head saved to {args.output_dir}: ATSCalibrator.from_pretrained({args.output_dir!r}, base_model=...)")
    return {"before": before.scalars(), "after": after.scalars()}


if __name__ == "__main__":
    main()
