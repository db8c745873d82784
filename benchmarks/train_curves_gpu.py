"""Patched vs unpatched short training on the GPU: same seed, same data order, bf16, b = 0.1.

Unpatched: HF Trainer with label_smoothing_factor (LabelSmoother on full logits). Patched: the same
with apply_lsce_patch (fused op, no logits). Prints both loss curves and their largest relative
difference, and writes JSON.

    python benchmarks/train_curves_gpu.py --steps 100 --out curves.json
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hf_lsce import apply_lsce_patch, revert_lsce_patch


class Data(torch.utils.data.Dataset):
    """Token sequences from a fixed random bigram chain (learnable), with variable-length padding."""

    def __init__(self, n, t, v, seed=0):
        g = torch.Generator().manual_seed(seed)
        nxt = torch.randint(0, v, (v, 4), generator=g)
        rows = []
        for i in range(n):
            x = [int(torch.randint(0, v, (1,), generator=g))]
            for _ in range(t - 1):
                x.append(int(nxt[x[-1], torch.randint(0, 4, (1,), generator=g)]))
            ids = torch.tensor(x)
            lab = ids.clone()
            lab[t - int(torch.randint(0, t // 4, (1,), generator=g)):] = -100
            rows.append({"input_ids": ids, "labels": lab})
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def train(patched, steps, out_dir, vocab):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if patched:
        apply_lsce_patch(model)
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=steps, learning_rate=1e-3, warmup_steps=10, bf16=True, logging_steps=1,
                             label_smoothing_factor=0.1, report_to=[], save_strategy="no", seed=0,
                             data_seed=0, dataloader_num_workers=0)
    tr = Trainer(model=model, args=args, train_dataset=Data(steps * 16, 256, vocab))
    tr.train()
    if patched:
        revert_lsce_patch(model)
    hist = [h for h in tr.state.log_history if "loss" in h and "train_loss" not in h]
    return [h["loss"] for h in hist], [h.get("grad_norm") for h in hist], torch.cuda.max_memory_allocated() / 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default="train_curves_gpu.json")
    a = ap.parse_args()
    torch.cuda.reset_peak_memory_stats()
    ref_loss, ref_gn, ref_mem = train(False, a.steps, "/tmp/ref", a.vocab)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    our_loss, our_gn, our_mem = train(True, a.steps, "/tmp/ours", a.vocab)
    rl = max(abs(x - y) / abs(y) for x, y in zip(our_loss, ref_loss))
    rg = max(abs(x - y) / abs(y) for x, y in zip(our_gn, ref_gn) if x is not None and y)
    res = dict(device=torch.cuda.get_device_name(), steps=a.steps, vocab=a.vocab, unpatched_loss=ref_loss,
               patched_loss=our_loss, unpatched_grad_norm=ref_gn, patched_grad_norm=our_gn,
               max_rel_diff_loss=rl, max_rel_diff_grad_norm=rg, peak_mib_unpatched=ref_mem, peak_mib_patched=our_mem)
    json.dump(res, open(a.out, "w"), indent=1)
    for i in range(0, a.steps, max(1, a.steps // 10)):
        print(f"step {i + 1:4d}  loss unpatched {ref_loss[i]:.4f}  patched {our_loss[i]:.4f}")
    print(f"largest relative difference: loss {rl:.2e}, grad norm {rg:.2e}; "
          f"peak memory unpatched {ref_mem:.0f} MiB, patched {our_mem:.0f} MiB")


if __name__ == "__main__":
    main()
