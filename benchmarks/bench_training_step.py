"""Full training steps (forward, backward, AdamW) on real model shapes: tokens/s, peak memory, and the
largest batch that fits, for HF's default loss, apply_lsce_patch, and Liger's patch; one process.

Models: Llama-3.2-1B, Gemma2-2B and Qwen3-1.7B configurations (real vocabularies and sizes), random
weights, bf16 parameters with torch AdamW (bf16 states), gradient checkpointing on for every method
(the setting in which a 1-2B model is fine-tuned on one GPU and the lm_head/loss dominates memory).

Methods (b = label smoothing):
  hf       b=0.1  the unpatched model's logits + transformers' LabelSmoother (what the Trainer does
                  with --label_smoothing_factor 0.1)
  hf_lsce  b=0.1  apply_lsce_patch(model, label_smoothing=0.1)
  hf       b=0    the unpatched model with labels (HF's ForCausalLMLoss)
  hf_lsce  b=0
  liger    b=0    Liger-Kernel's patch, fused linear cross-entropy only (rope/norm/MLP kernels off,
                  so only the loss differs); b=0 because Liger loses the Trainer's smoothing

    python benchmarks/bench_training_step.py --models llama3.2-1b,qwen3-1.7b --out-dir results
    python benchmarks/bench_training_step.py --feasible --out-dir results   (see FEASIBLE_BATCHES)
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import time

import torch

MODELS = {
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192),
    "gemma2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                      sliding_window=4096, tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, max_position_embeddings=8192),
}
METHODS = [("hf", 0.1), ("hf_lsce", 0.1), ("hf", 0.0), ("hf_lsce", 0.0), ("liger", 0.0)]


def build(name, checkpointing=True):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(MODELS[name])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def liger_patch(model_type, model):
    import liger_kernel.transformers as lk

    fn = getattr(lk, f"apply_liger_kernel_to_{model_type}")
    params = inspect.signature(fn).parameters
    kw = {k: False for k in ("rope", "rms_norm", "swiglu", "geglu", "cross_entropy") if k in params}
    fn(fused_linear_cross_entropy=True, model=model, **kw)


def step_fn(model, method, b):
    from transformers.trainer_pt_utils import LabelSmoother

    smoother = LabelSmoother(epsilon=b)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, foreach=True)

    def step(ids):
        if method == "hf" and b > 0:
            out = model(input_ids=ids)
            loss = smoother(out, ids, shift_labels=True)
        else:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


def measure(model, method, b, batch, seq, steps, warmup=2):
    step, opt = step_fn(model, method, b)
    g = torch.Generator(device="cuda").manual_seed(0)
    v = model.config.vocab_size
    ids = [torch.randint(0, v, (batch, seq), device="cuda", generator=g) for _ in range(warmup + steps)]
    for i in range(warmup):
        step(ids[i])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [float(step(ids[warmup + i])) for i in range(steps)]
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    peak = torch.cuda.max_memory_allocated() / 2**30
    del opt
    return dict(tokens_per_s=batch * seq / dt, step_s=dt, peak_gib=peak, loss=losses[-1])


def fits(model, method, b, batch, seq):
    try:
        step, opt = step_fn(model, method, b)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
        step(ids)
        torch.cuda.synchronize()
        ok = True
    except torch.OutOfMemoryError:
        ok = False
    finally:
        opt = step = ids = None  # noqa: F841
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    return ok


def largest_batch(model, method, b, seq, start, cap):
    """Doubling, then bisection between the last fit and the first OOM (sequences of ``seq`` tokens)."""
    lo, hi = 0, None
    bs = start
    while bs <= cap:
        if fits(model, method, b, bs, seq):
            lo, bs = bs, bs * 2
        else:
            hi = bs
            break
    if hi is None:
        return lo, True  # capped
    while hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        if fits(model, method, b, mid, seq):
            lo = mid
        else:
            hi = mid
    return lo, False


def _record(row, results, out_dir, stem):
    """Print a finished row and rewrite ``stem``.json with every row so far (a crash keeps them)."""
    print(json.dumps(row), flush=True)
    results.append(row)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=results), f, indent=1)


def run_model(name, args, results):
    from hf_lsce import revert_lsce_patch

    for method, b in METHODS:
        if method == "liger" and args.no_liger:
            continue
        row = dict(model=name, method=method, label_smoothing=b, seq=args.seq, batch=args.batch,
                   layers=MODELS[name]["num_hidden_layers"])
        model = None
        try:
            model = _patched(name, method, b)
            row.update(measure(model, method, b, args.batch, args.seq, args.steps))
            if args.search:
                gc.collect()
                torch.cuda.empty_cache()
                row["max_batch"], row["max_batch_capped"] = largest_batch(model, method, b, args.seq, args.batch,
                                                                          args.max_batch)
                row["max_tokens"] = row["max_batch"] * args.seq
            if method == "hf_lsce":
                revert_lsce_patch(model)
        except ImportError as e:
            row["error"] = f"missing: {e}"
        except Exception as e:  # report, never drop silently
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        finally:
            del model
            gc.collect()
            torch.cuda.empty_cache()
        _record(row, results, args.out_dir, "bench_training_step")


# The fastest setting that fits: each method at the same batch, first without gradient checkpointing,
# then (if that runs out of memory) with it. Memory the loss no longer takes can buy back the
# recomputation of the decoder layers; these batches are where that happens for the HF default.
FEASIBLE_BATCHES = {"llama3.2-1b": (16, 32), "qwen3-1.7b": (16, 32), "gemma2-2b": (8, 12, 16)}
FEASIBLE_METHODS = [("hf", 0.1), ("hf_lsce", 0.1), ("liger", 0.0)]


def _patched(name, method, b, checkpointing=True):
    """The model of ``name`` set up for ``method``: HF as is, hf_lsce's patch at smoothing b, or Liger's."""
    from hf_lsce import apply_lsce_patch

    model = build(name, checkpointing=checkpointing)
    if method == "hf_lsce":
        apply_lsce_patch(model, label_smoothing=b)
    elif method == "liger":
        liger_patch(model.config.model_type, model)
    return model


def run_feasible(name, args, results):
    for batch in args.feasible_batches or FEASIBLE_BATCHES[name]:
        for method, b in FEASIBLE_METHODS:
            if method == "liger" and args.no_liger:
                continue
            row = dict(model=name, method=method, label_smoothing=b, seq=args.seq, batch=batch,
                       layers=MODELS[name]["num_hidden_layers"])
            for ckpt in (False, True):
                model = None
                try:
                    model = _patched(name, method, b, ckpt)
                    row.update(measure(model, method, b, batch, args.seq, args.steps), checkpointing=ckpt)
                    row.pop("error", None)
                    break
                except torch.OutOfMemoryError:
                    row["error"] = "out of memory with and without gradient checkpointing"
                except ImportError as e:
                    row["error"] = f"missing: {e}"
                    break
                except Exception as e:  # report, never drop silently
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    break
                finally:
                    del model
                    gc.collect()
                    torch.cuda.empty_cache()
            _record(row, results, args.out_dir, "bench_training_feasible")


def feasible_table(rows):
    lines = ["| model | batch (tokens) | method | b | gradient checkpointing | tokens/s | peak GiB | vs HF |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tokens = f"{r['batch'] * r['seq']:,}"
        if "error" in r:
            lines.append(f"| {r['model']} | {tokens} | {r['method']} | {r['label_smoothing']} | {r['error']} | | | |")
            continue
        ref = next((x for x in rows if x["model"] == r["model"] and x["batch"] == r["batch"]
                    and x["method"] == "hf" and "error" not in x), None)
        sp = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        lines.append(f"| {r['model']} | {tokens} | {r['method']} | {r['label_smoothing']} | "
                     f"{'on' if r['checkpointing'] else 'off'} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} | {sp} |")
    return "\n".join(lines)


def plot_feasible(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    groups = list(dict.fromkeys((r["model"], r["batch"] * r["seq"]) for r in ok))
    w = 0.8 / len(FEASIBLE_METHODS)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(groups)), 4.5))
    for j, (m, b) in enumerate(FEASIBLE_METHODS):
        for i, (mo, tok) in enumerate(groups):
            r = next((x for x in ok if x["model"] == mo and x["batch"] * x["seq"] == tok and x["method"] == m), None)
            if r is None:
                continue
            ax.bar(i + j * w, r["tokens_per_s"], width=w, color=f"C{j}", hatch="//" if r["checkpointing"] else None,
                   edgecolor="black", label=f"{m} b={b}" if i == 0 else None)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{mo}\n{tok:,} tokens" for mo, tok in groups], fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_title("Fastest setting that fits (hatched: gradient checkpointing needed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows):
    lines = ["| model | method | b | tokens/s | peak GiB | vs HF (same b) | largest batch (tokens) | vs HF |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['label_smoothing']} | {r['error']} | | | | |")
            continue
        ref = next((x for x in rows if x["model"] == r["model"] and x["method"] == "hf"
                    and x["label_smoothing"] == r["label_smoothing"] and "error" not in x), None)
        sp = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        mt = r.get("max_tokens")
        mb = (f"{mt:,}{'+' if r.get('max_batch_capped') else ''}" if mt is not None else "-")
        rb = f"{mt / ref['max_tokens']:.2f}x" if ref and mt and ref.get("max_tokens") else "-"
        lines.append(f"| {r['model']} ({r['layers']} layers) | {r['method']} | {r['label_smoothing']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} | {sp} | {mb} | {rb} |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in ok))
    labels = [f"{m} b={b}" for m, b in METHODS]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    w = 0.8 / len(labels)
    for j, (m, b) in enumerate(METHODS):
        for k, key in enumerate(("tokens_per_s", "max_tokens")):
            vals = [next((r.get(key) or 0 for r in ok if r["model"] == mo and r["method"] == m
                          and r["label_smoothing"] == b), 0) for mo in models]
            axes[k].bar([i + j * w for i in range(len(models))], vals, width=w, label=labels[j])
    for ax, t in zip(axes, ("tokens / s (same batch)", "largest batch (tokens)")):
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(models))])
        ax.set_xticklabels(models)
        ax.set_title(t)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3.2-1b,qwen3-1.7b,gemma2-2b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--no-search", dest="search", action="store_false")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--feasible", action="store_true",
                    help="instead: the fastest setting that fits (checkpointing off, else on) at FEASIBLE_BATCHES")
    ap.add_argument("--feasible-batches", type=lambda x: [int(b) for b in x.split(",")], default=None,
                    help="with --feasible: these batch sizes (sequences) instead of FEASIBLE_BATCHES")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    stem, run, tab, draw = (("bench_training_feasible", run_feasible, feasible_table, plot_feasible) if args.feasible
                            else ("bench_training_step", run_model, table, plot))
    path = os.path.join(args.out_dir, f"{stem}.json")
    results = json.load(open(path))["rows"] if os.path.exists(path) else []
    for name in args.models.split(","):
        run(name, args, results)
    md = tab(results)
    print(md)
    with open(os.path.join(args.out_dir, f"{stem}.md"), "w") as f:
        f.write(md + "\n")
    draw(results, os.path.join(args.out_dir, f"{stem}.png"))


if __name__ == "__main__":
    main()
