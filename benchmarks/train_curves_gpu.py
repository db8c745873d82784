"""Patched vs unpatched supervised fine-tuning on the GPU: same seed, same data order, bf16, b = 0.1.

A small Llama-config model (random init) and a byte-level BPE tokenizer trained on the data are
fine-tuned on Alpaca-style records (response-only labels). Unpatched: the HF Trainer with
label_smoothing_factor (LabelSmoother on full logits). Patched: the same with apply_lsce_patch
(fused op, no logits). Prints both curves and their largest relative difference; writes JSON and a
plot (loss and gradient norm, both runs overlaid).

    python benchmarks/train_curves_gpu.py --data alpaca_en_demo.json --steps 300 --out-dir results
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_lsce import apply_lsce_patch, revert_lsce_patch


def alpaca_dataset(path, vocab, max_length=512):
    """Alpaca records, a byte-level BPE tokenizer trained on them, response-only labels."""
    from hf_lsce.ats.training import load_instruction_records, tokenize_records
    from hf_lsce.tokenizer import train_bpe_tokenizer

    recs = load_instruction_records(path)
    tok = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in recs], vocab_size=vocab)
    rows = tokenize_records(recs, tok, max_length=max_length)
    return [{"input_ids": torch.tensor(r["input_ids"]), "labels": torch.tensor(r["labels"])} for r in rows], tok


def train(patched, steps, out_dir, data, tok):
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if patched:
        apply_lsce_patch(model)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=steps, learning_rate=1e-3, warmup_steps=10, bf16=True, logging_steps=1,
                             label_smoothing_factor=0.1, report_to=[], save_strategy="no", seed=0,
                             data_seed=0, dataloader_num_workers=0, remove_unused_columns=False)
    from hf_lsce.ats.training import PadCollator

    tr = Trainer(model=model, args=args, train_dataset=data, data_collator=PadCollator(tok.pad_token_id))
    tr.train()
    if patched:
        revert_lsce_patch(model)
    hist = [h for h in tr.state.log_history if "loss" in h and "train_loss" not in h]
    return [h["loss"] for h in hist], [h.get("grad_norm") for h in hist], torch.cuda.max_memory_allocated() / 2**20


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = range(1, len(res["unpatched_loss"]) + 1)
    for ax, key, title in ((axes[0], "loss", "training loss (b = 0.1)"), (axes[1], "grad_norm", "gradient norm")):
        ax.plot(steps, res[f"unpatched_{key}"], lw=2.5, alpha=0.6, label="HF LabelSmoother (logits)")
        ax.plot(steps, res[f"patched_{key}"], lw=1, ls="--", color="k", label="hf_lsce fused op")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{res['device']}: max relative difference loss {res['max_rel_diff_loss']:.1e}, "
                 f"grad norm {res['max_rel_diff_grad_norm']:.1e}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="Alpaca-style JSON (e.g. ../shared/data/alpaca/alpaca_en_demo.json)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--out-dir", default="curves_out")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    data, tok = alpaca_dataset(a.data, a.vocab)
    vocab = len(tok)
    torch.cuda.reset_peak_memory_stats()
    ref_loss, ref_gn, ref_mem = train(False, a.steps, "/tmp/ref", data, tok)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    our_loss, our_gn, our_mem = train(True, a.steps, "/tmp/ours", data, tok)
    rl = max(abs(x - y) / abs(y) for x, y in zip(our_loss, ref_loss))
    rg = max(abs(x - y) / abs(y) for x, y in zip(our_gn, ref_gn) if x is not None and y)
    res = dict(device=torch.cuda.get_device_name(), steps=a.steps, vocab=vocab, records=len(data),
               unpatched_loss=ref_loss, patched_loss=our_loss, unpatched_grad_norm=ref_gn, patched_grad_norm=our_gn,
               max_rel_diff_loss=rl, max_rel_diff_grad_norm=rg, peak_mib_unpatched=ref_mem, peak_mib_patched=our_mem)
    json.dump(res, open(os.path.join(a.out_dir, "train_curves_alpaca.json"), "w"), indent=1)
    plot(res, os.path.join(a.out_dir, "train_curves_alpaca.png"))
    for i in range(0, a.steps, max(1, a.steps // 10)):
        print(f"step {i + 1:4d}  loss unpatched {ref_loss[i]:.4f}  patched {our_loss[i]:.4f}")
    print(f"largest relative difference: loss {rl:.2e}, grad norm {rg:.2e}; "
          f"peak memory unpatched {ref_mem:.0f} MiB, patched {our_mem:.0f} MiB")


if __name__ == "__main__":
    main()
