"""Supervised fine-tuning with label smoothing through the fused op, with calibration logged as it trains.

TRL's SFTTrainer drives the smoothing (`label_smoothing_factor`); `apply_lsce_patch` makes the model
compute its loss without the N x V logits; `CalibrationCallback` scores held-out multiple-choice
questions at every evaluation and logs accuracy, ECE and RMS next to the loss.

A real run (one GPU):

    python examples/sft_label_smoothing.py --model meta-llama/Llama-3.2-1B --dataset tatsu-lab/alpaca \
        --label-smoothing 0.1 --eval-tasks mmlu,arc_easy --data-dir ../shared/data --max-steps 1000

An offline smoke run on CPU (a small random Llama and a tokenizer trained on the data; about a minute):

    python examples/sft_label_smoothing.py --tiny
"""
from __future__ import annotations

import argparse
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_ALPACA = os.path.join(HERE, "..", "..", "shared", "data", "alpaca", "alpaca_en_demo.json")
LOCAL_DATA = os.path.join(HERE, "..", "..", "shared", "data")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.2-1B", help="hub name or local path of a causal LM")
    p.add_argument("--dataset", default=LOCAL_ALPACA if os.path.exists(LOCAL_ALPACA) else "tatsu-lab/alpaca",
                   help="Alpaca-style JSON/JSONL (instruction/input/output or prompt/completion) or a hub dataset")
    p.add_argument("--limit", type=int, default=None, help="use the first N records")
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--eval-tasks", default="mmlu,arc_easy", help="held-out multiple choice scored during training")
    p.add_argument("--data-dir", default=LOCAL_DATA if os.path.isdir(LOCAL_DATA) else None,
                   help="local MMLU/ARC/HellaSwag files (default: ../shared/data if present, else the hub)")
    p.add_argument("--eval-limit", type=int, default=200, help="questions per task at each evaluation")
    p.add_argument("--output-dir", default="runs/sft_label_smoothing")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--eval-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="offline CPU smoke run: small random Llama, 20 steps")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
    from trl import SFTConfig, SFTTrainer

    from hf_lsce import apply_lsce_patch
    from hf_lsce.ats.training import load_instruction_records
    from hf_lsce.calibration import CalibrationCallback

    set_seed(args.seed)
    if args.tiny:
        args.limit, args.max_steps, args.eval_steps = args.limit or 200, 20, 10
        args.eval_tasks, args.eval_limit, args.max_length, args.lr, args.grad_accum = "arc_easy", 24, 256, 3e-3, 1
    records = load_instruction_records(args.dataset, args.limit)
    n_eval = max(1, len(records) // 20)
    train, held_out = records[:-n_eval], records[-n_eval:]

    if args.tiny:
        from hf_lsce.synthetic import small_llama
        from hf_lsce.tokenizer import train_bpe_tokenizer

        tokenizer = train_bpe_tokenizer((r["prompt"] + r["completion"] for r in records), vocab_size=1024,
                                        model_max_length=512)
        model = small_llama(tokenizer, hidden=64, layers=2)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if torch.cuda.is_available()
                                                     else torch.float32)
    apply_lsce_patch(model)  # training loss through the fused op; the Trainer's smoothing reaches it

    cuda = torch.cuda.is_available()
    config = SFTConfig(output_dir=args.output_dir, max_steps=args.max_steps, learning_rate=args.lr,
                       per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
                       label_smoothing_factor=args.label_smoothing, max_length=args.max_length,
                       eval_strategy="steps", eval_steps=args.eval_steps, logging_steps=max(1, args.eval_steps // 4),
                       save_strategy="no", report_to="none", bf16=cuda, use_cpu=not cuda, seed=args.seed,
                       gradient_checkpointing=cuda and not args.tiny)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(train),
                         eval_dataset=Dataset.from_list(held_out), processing_class=tokenizer)
    callback = CalibrationCallback(args.eval_tasks, data_dir=args.data_dir, limit=args.eval_limit,
                                   tokenizer=tokenizer).attach(trainer)
    trainer.train()
    trainer.save_model(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    last = callback.history[-1] if callback.history else {}
    print(f"saved to {args.output_dir}; calibration at the last evaluation:")
    print(json.dumps(last, indent=1))
    return last


if __name__ == "__main__":
    main()
