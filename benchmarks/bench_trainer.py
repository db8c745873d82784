"""Fine-tuning through the Hugging Face Trainer with bf16=True (the set-up users run; ``--fp16``: fp16=True), one
process: tokens/s, peak memory, the largest batch that fits, and evidence that the patch engaged.

For each model, the same data (real instruction text packed into sequences) and the same Trainer arguments
(bf16 mixed precision, AdamW fused, gradient checkpointing with ``--checkpointing`` or where a run ran out of memory):

  hf        b=0.1  the unpatched model, the Trainer's --label_smoothing_factor 0.1 (its LabelSmoother on logits)
  hf_lsce   b=0.1  apply_lsce_patch(model), the same flag
  hf        b=0    the unpatched model
  hf_lsce   b=0
  M+compile        method M with the Trainer's torch_compile=True (inductor; the patched forward compiles whole,
                   the op as custom operators), compared with hf+compile (only with --methods); M+compile-cg the
                   same with torch_compile_mode="reduce-overhead" (CUDA graphs), compared with hf+compile-cg
  liger     b=0    the Trainer's own use_liger_kernel=True (Liger-Kernel's kernels and its fused linear
                   cross-entropy; with --methods liger:0.1 the Trainer's smoothing, which builds the logits)
  hf_lsce_liger    the patch and use_liger_kernel=True: Liger's other kernels beside hf_lsce's loss (with --methods)

``--lora``: PEFT LoRA (r = 16 on q, k, v, o) on bf16 base weights, the head frozen. Each row: tokens/s (steps after two
warm-up steps), peak memory, lm_head and fused calls (0 and one per micro-batch when the patch engaged), a patched
run's first-batch loss against the model's own (the unpatched logits smoothed as the Trainer does, plus an MoE's router
term), and with --search the largest batch that fits (a size that does not fit is reported, never a crash). Models:
installed checkpoints (hf_lsce.checkpoints) and the configurations in CONFIGS with random weights.

    python benchmarks/bench_trainer.py --models gemma-3-270m,llama3.2-1b --out-dir results [--search M]
    python benchmarks/bench_trainer.py --models llama3-8b --lora --checkpointing --seq 4096 --search llama3-8b
    python benchmarks/bench_trainer.py --smoke   (CPU, a tiny model: the code path)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the package from this checkout where it is not installed
HALF = [torch.bfloat16]  # the Trainer's mixed precision: bf16, or fp16 with --fp16
# Real models' configurations with random weights (no checkpoint to stage). distributed_matrix.py uses "llama3-8b".
CONFIGS = {
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
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=8192),
    # a small mixture of experts of Qwen3-MoE's shape (Qwen3-30B-A3B's vocabulary and expert width, fewer and
    # narrower layers), its router's auxiliary loss on as TRL turns it on
    "qwen3-moe-small": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                            moe_intermediate_size=768, num_hidden_layers=12, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                            output_router_logits=True, router_aux_loss_coef=0.001, tie_word_embeddings=False,
                            max_position_embeddings=8192),
    # the real models' configurations with random weights (no checkpoint to stage)
    "smollm2-135m-config": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192),
    "gemma3-270m-config": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                               num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                               sliding_window=512, query_pre_attn_scalar=256, rope_theta=1000000.0,
                               tie_word_embeddings=True, max_position_embeddings=32768),
    "smoke": dict(model_type="llama", vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
}
METHODS = [("hf", 0.1), ("hf_lsce", 0.1), ("hf", 0.0), ("hf_lsce", 0.0), ("liger", 0.0)]
OPTIMIZER = "adamw_torch_fused"  # the Trainer's optimizer on CUDA (every table says so)


def _text_ids(tok, n_tokens):
    sys.path.insert(0, ROOT)
    from hf_lsce.data import load_instruction_records

    path = os.environ.get("HF_LSCE_ALPACA", os.path.join(os.path.dirname(ROOT), "shared", "data", "alpaca",
                                                         "alpaca_en_demo.json"))
    recs = load_instruction_records(path if os.path.exists(path) else "trivia_qa,sciq,openbookqa")
    ids = []
    for r in recs:
        ids += tok(r["prompt"] + r["completion"])["input_ids"]
        if len(ids) >= n_tokens:
            break
    while len(ids) < n_tokens:  # repeat the text if there is not enough of it
        ids = ids + ids
    return torch.tensor(ids[:n_tokens])


def load(name, device, dtype=torch.float32):
    """(model in ``dtype`` on device, tokenizer or None). A configuration is built on the device in that dtype (an 8B
    model's fp32 initialisation on the host would take minutes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name in CONFIGS:
        spec = dict(CONFIGS[name])
        cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
        torch.manual_seed(0)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype), None
    sys.path.insert(0, ROOT)
    from hf_lsce.checkpoints import load_model_and_tokenizer

    return load_model_and_tokenizer(name, dtype="bf16" if dtype == torch.bfloat16 else "fp32", device=device)


def with_lora(model):
    """PEFT LoRA, r = 16 on the attention projections; the base (and the head) frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


@torch.no_grad()
def first_batch_losses(model, batch, b, device):
    """(the model's own loss, the patched loss) on one batch under bf16 autocast (CUDA): the unpatched forward's
    logits smoothed as the Trainer's LabelSmoother does, plus a mixture of experts' router term (what its forward
    adds to its loss), against the patched forward's fused loss on the same weights. Train mode, as in a step."""
    from transformers.trainer_pt_utils import LabelSmoother

    from hf_lsce.patching import unwrap_model
    from hf_lsce.patching.forward import original_forward

    lm = unwrap_model(model)
    lm.train()
    ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
    with torch.autocast(device, dtype=HALF[0], enabled=device == "cuda"):
        out = original_forward(lm)(input_ids=ids, return_dict=True)
        own = LabelSmoother(b)(out, labels, shift_labels=True) if b else torch.nn.functional.cross_entropy(
            out.logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten())
        if getattr(out, "aux_loss", None) is not None:
            own = own + lm.router_aux_loss_coef * out.aux_loss
        del out
        ours = lm(input_ids=ids, labels=labels, label_smoothing=b).loss
    return float(own), float(ours)


class _Data(torch.utils.data.Dataset):
    def __init__(self, ids, seq):
        self.rows = ids[: (len(ids) // seq) * seq].view(-1, seq)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


class _Timer:
    """Times the steps after ``warmup``; on CUDA also counts the host synchronisations of the last warm-up step
    (torch's sync debug mode warns on every synchronising call: .item(), bool(), .tolist(), nonzero, a blocking
    copy), outside the timed steps."""

    def __init__(self, warmup):
        import warnings

        from transformers import TrainerCallback

        outer = self

        class CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                cuda = torch.cuda.is_available()
                if cuda and warmup >= 1 and state.global_step == warmup - 1:
                    outer._catch = warnings.catch_warnings(record=True)
                    outer._log = outer._catch.__enter__()
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                if state.global_step == warmup:
                    if outer._catch is not None:
                        torch.cuda.set_sync_debug_mode("default")
                        outer._catch.__exit__(None, None, None)
                        outer.syncs = sum("synchroniz" in str(w.message) for w in outer._log)
                        outer._catch = None
                    if cuda:
                        torch.cuda.synchronize()
                    outer.t0 = time.perf_counter()

            def on_train_end(self, args, state, control, **kw):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                outer.t1 = time.perf_counter()
        self.cb = CB()
        self.t0 = self.t1 = None
        self._catch = None
        self.syncs = None


def run_one(name, method, b, batch, seq, steps, out_dir, device, warmup=2, checkpointing=False, callbacks=(),
            lora=False, check=True):
    """One Trainer run; returns a row (tokens/s, peak memory, lm_head calls, fused calls). ``callbacks``: more
    TrainerCallbacks (a profiler's, for instance)."""
    from transformers import Trainer, TrainingArguments

    from hf_lsce import apply_lsce_patch
    from hf_lsce.patching import ENGAGEMENT

    # the Trainer's torch_compile=True (inductor): +compile the default mode, +compile-cg mode="reduce-overhead"
    method_base, _, compile_kind = method.partition("+")
    compiled = compile_kind in ("compile", "compile-cg")
    if compile_kind and not compiled:
        raise ValueError(f"unknown method suffix +{compile_kind} (use +compile or +compile-cg)")
    model, tok = load(name, device, HALF[0] if lora else torch.float32)
    v = model.config.get_text_config().vocab_size
    ids = _text_ids(tok, batch * seq * (steps + warmup) + 1) if tok is not None else \
        torch.randint(0, v, (batch * seq * (steps + warmup) + 1,), generator=torch.Generator().manual_seed(0))
    if lora:
        model = with_lora(model)
    data = _Data(ids, seq)
    losses = None
    if method_base in ("hf_lsce", "hf_lsce_liger"):
        apply_lsce_patch(model)
        if check:  # up to 2 rows: the check's full logits must fit beside the step
            rows = [data[i] for i in range(min(batch, 2))]
            losses = first_batch_losses(model, {k: torch.stack([r[k] for r in rows]) for k in rows[0]}, b, device)
            if device == "cuda":
                torch.cuda.empty_cache()
    calls = []
    if not compiled:  # under torch.compile a hook that counts would be traced (its guard recompiles every step)
        model.get_output_embeddings().register_forward_hook(lambda *a: calls.append(1))
    cuda = device == "cuda"
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=batch, max_steps=steps + warmup,
                             learning_rate=1e-5, lr_scheduler_type="constant", label_smoothing_factor=b,
                             bf16=cuda and HALF[0] == torch.bfloat16, fp16=cuda and HALF[0] == torch.float16,
                             use_cpu=not cuda, report_to=[], save_strategy="no", logging_steps=10 ** 6,
                             optim=OPTIMIZER if cuda else "adamw_torch", seed=0, disable_tqdm=True,
                             dataloader_drop_last=True, gradient_checkpointing=checkpointing,
                             use_liger_kernel=method_base in ("liger", "hf_lsce_liger"), torch_compile=compiled,
                             **({"torch_compile_mode": "reduce-overhead"} if compile_kind == "compile-cg" else {}))
    timer = _Timer(warmup)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer.cb, *callbacks])
    before = ENGAGEMENT.fused_calls
    import hf_lsce.ops.fused_pass as fp

    from hf_lsce.ops import budget as bud

    real_pass, pass_dtypes = fp.triton_fused_pass, set()  # which dtype the fused path ran in (not under compile)
    fp.triton_fused_pass = lambda h, *a, **k: pass_dtypes.add(str(h.dtype)[6:]) or real_pass(h, *a, **k)
    real_plan, plans = bud.plan_for, []  # the plan memory="auto" gave each training call
    bud.plan_for = lambda *a, **k: plans.append(real_plan(*a, **k)) or plans[-1]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if compiled:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    try:
        trainer.train()
    finally:
        fp.triton_fused_pass, bud.plan_for = real_pass, real_plan
    dt = (timer.t1 - timer.t0) / steps
    row = dict(model=name, method=method, label_smoothing=b, batch=batch, seq=seq, tokens_per_s=batch * seq / dt,
               step_s=dt, peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
               lm_head_calls=None if compiled else len(calls), fused_calls=ENGAGEMENT.fused_calls - before,
               checkpointing=checkpointing, lora=lora,
               loss=trainer.state.log_history[-1].get("train_loss"), host_syncs_per_step=timer.syncs,
               fused_pass_dtypes=sorted(pass_dtypes), precision=str(HALF[0])[6:])
    if losses is not None:
        row["first_batch_own_loss"], row["first_batch_patched_loss"] = losses
    if plans:
        p = plans[-1]
        row["plan"] = f"{bud.describe_plan(p)}, {bud.describe(p.nbytes)}"
    if compiled:  # what Dynamo did: graphs compiled and graph breaks (a break or a recompile costs each step)
        c = torch._dynamo.utils.counters
        row["compiled_graphs"] = int(c["stats"].get("unique_graphs", 0))
        row["graph_breaks"] = int(sum(c["graph_break"].values()))
    if method.startswith("hf_lsce"):
        # CUDA-graph replays run no Python: the op reports the warm-up and recorded calls only
        counted = row["fused_calls"] >= 1 if compile_kind == "compile-cg" else row["fused_calls"] == steps + warmup
        row["engaged"] = (compiled or row["lm_head_calls"] == 0) and counted
    # no revert: the Trainer's accelerate wrapper now wraps the patched forward, and the model is dropped anyway
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def fits(name, method, b, batch, seq, out_dir, device, **kw):
    """Whether three steps at this batch run (one step does not show the optimizer's state and the allocator's steady
    state: a size that passed one step failed a timed run); out of memory (in a step or the check) is an answer, not
    a crash."""
    try:
        run_one(name, method, b, batch, seq, 3, out_dir, device, warmup=0, check=False, **kw)
        return True
    except (torch.OutOfMemoryError, ValueError) as e:  # (the op's own refusal: memory='auto' found too little free)
        if isinstance(e, ValueError) and not str(e).startswith("memory="):
            raise
        gc.collect()
        torch.cuda.empty_cache()
        return False


def largest_batch(name, method, b, seq, out_dir, device, start=8, cap=512, **kw):
    """(largest batch that ran, capped): doubling from ``start``, then bisection to within 1/8."""
    lo, hi, bs = 0, None, start
    while bs <= cap:
        if fits(name, method, b, bs, seq, out_dir, device, **kw):
            lo, bs = bs, bs * 2
        else:
            hi = bs
            break
    if hi is None:
        return lo, True
    while hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        if fits(name, method, b, mid, seq, out_dir, device, **kw):
            lo = mid
        else:
            hi = mid
    return lo, False


def merge_repeats(runs):
    """One row per (model, method, b, batch): the median run's row by tokens/s, with every run's tokens/s kept
    (``tokens_per_s_runs``) and their range; a method whose every run failed keeps its first error."""
    groups = {}
    for r in runs:
        groups.setdefault((r["model"], r["method"], r["label_smoothing"], r.get("batch")), []).append(r)
    rows = []
    for group in groups.values():
        ok = sorted((r for r in group if "error" not in r), key=lambda r: r["tokens_per_s"])
        if not ok:
            rows.append(group[0])
            continue
        row = dict(ok[(len(ok) - 1) // 2])  # the lower median: a real run, not an average of two
        row.pop("repeat", None)
        row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in ok]
        row["failed_runs"] = len(group) - len(ok)
        rows.append(row)
    return rows


def table(rows):
    lines = ["| model | method | b | batch x seq | tokens/s | vs HF (same b) | peak GiB | lm_head calls | fused calls | "
             "host syncs / step | first batch: own / patched loss | train loss | largest batch | the op's plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['label_smoothing']} | {r.get('batch')} | {r['error']} "
                         "|||||||||")
            continue
        ref = next((x for x in rows if x["model"] == r["model"] and "error" not in x
                    and x["method"] == "+".join(["hf", *r["method"].split("+")[1:]])
                    and x["label_smoothing"] == r["label_smoothing"] and x["batch"] == r["batch"]), None)
        sp = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        runs = r.get("tokens_per_s_runs", [])
        tps = f"{r['tokens_per_s']:,.0f}" + (f" ({runs[0]:,.0f}-{runs[-1]:,.0f}, {len(runs)} runs)" if len(runs) > 1 else "")
        mb = f"{r['max_batch']}{'+' if r.get('max_batch_capped') else ''}" if "max_batch" in r else "-"
        if r.get("at_max_tokens_per_s"):
            mb += f": {r['at_max_tokens_per_s']:,.0f} tok/s" + (
                f", {r['at_max_peak_gib']:.1f} GiB" if r.get("at_max_peak_gib") else "") + (
                f", {r['at_max_plan']}" if r.get("at_max_plan") else "")
        fb = (f"{r['first_batch_own_loss']:.4f} / {r['first_batch_patched_loss']:.4f}"
              if "first_batch_own_loss" in r else "-")
        pk = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "-"
        method = r["method"] + (f" ({r['compiled_graphs']} graphs, {r['graph_breaks']} breaks)"
                                if "compiled_graphs" in r else "")
        fc = f"{r['fused_calls']}" + (f" (fused path: {', '.join(r['fused_pass_dtypes'])})"
                                      if r.get("fused_pass_dtypes") else "")
        loss = "-" if r.get("loss") is None else f"{r['loss']:.4f}"
        lines.append(f"| {r['model']} | {method} | {r['label_smoothing']} | {r['batch']} x {r['seq']} | "
                     f"{tps} | {sp} | {pk} | {'-' if r['lm_head_calls'] is None else r['lm_head_calls']} | {fc} | "
                     f"{r.get('host_syncs_per_step', '-')} | {fb} | {loss} | {mb} | {r.get('plan', '-')} |")
    return "\n".join(lines)


def plot(rows, path):
    """tokens/s of every row, grouped by (model, batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    groups = list(dict.fromkeys((r["model"], r["batch"]) for r in ok))
    kinds = list(dict.fromkeys((r["method"], r["label_smoothing"]) for r in ok))
    if not groups:
        return
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(groups)), 4.5))
    w = 0.8 / len(kinds)
    for r in ok:
        i, j = groups.index((r["model"], r["batch"])), kinds.index((r["method"], r["label_smoothing"]))
        ax.bar(i + j * w, r["tokens_per_s"], width=w, color=f"C{j}", label=f"{r['method']} b={r['label_smoothing']}")
    unique = dict(zip(*ax.get_legend_handles_labels()[::-1]))  # one legend entry per method
    ax.legend(unique.values(), unique.keys(), fontsize=7)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{mo}\nbatch {bs}" for mo, bs in groups], fontsize=8)
    ax.set_ylabel("tokens / s (Trainer, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct,llama3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--search", default="", help="models to search the largest batch for (comma-separated)")
    ap.add_argument("--no-liger", action="store_true")
    ap.add_argument("--methods", default=None,
                    help="a subset, e.g. hf:0.1,hf_lsce:0.1 (default: all five); a method ending in +compile runs with "
                         "the Trainer's torch_compile=True (+compile-cg: mode reduce-overhead) and is compared with "
                         "hf with the same suffix")
    ap.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out", help="folder for the JSON and tables")
    ap.add_argument("--deadline-s", type=float, default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every method this many times, interleaved (hf, hf_lsce, hf, hf_lsce, ...), and report "
                         "the median tokens/s with its range: one short run per method is noisy on a launch-bound step")
    ap.add_argument("--lora", action="store_true", help="PEFT LoRA r=16 on q/k/v/o over bf16 base weights, head frozen")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing from the start")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, two steps")
    ap.add_argument("--fp16", action="store_true", help="the Trainer's fp16=True (and an fp16 LoRA base) for bf16")
    args = ap.parse_args()
    if args.fp16:
        HALF[0] = torch.float16
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    start = time.time()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.models, args.batch, args.seq, args.steps, args.no_liger = "smoke", 2, 32, 2, True
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "bench_trainer.json")
    rows, runs = [], []
    for name in args.models.split(","):
        methods = METHODS if not args.methods else [(m.split(":")[0], float(m.split(":")[1]))
                                                    for m in args.methods.split(",")]
        for rep, (method, b) in [(k, mb) for k in range(args.repeats) for mb in methods]:
            if method in ("liger", "hf_lsce_liger") and args.no_liger:
                continue
            if args.deadline_s is not None and time.time() - start > args.deadline_s:
                print(f"deadline: skipping {name} {method} b={b}", flush=True)
                continue
            row = dict(model=name, method=method, label_smoothing=b, batch=args.batch, seq=args.seq)
            opts = dict(lora=args.lora, checkpointing=args.checkpointing)
            try:
                try:
                    row = run_one(name, method, b, args.batch, args.seq, args.steps, args.out_dir, device, **opts)
                except torch.OutOfMemoryError:
                    if args.checkpointing:
                        raise
                    gc.collect()
                    torch.cuda.empty_cache()
                    row = run_one(name, method, b, args.batch, args.seq, args.steps, args.out_dir, device,
                                  **dict(opts, checkpointing=True))
            except Exception as e:  # noqa: BLE001 - report (out of memory included), never drop silently
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            try:
                if name in args.search.split(",") and b == 0.1:
                    row["max_batch"], row["max_batch_capped"] = largest_batch(
                        name, method, b, args.seq, args.out_dir, device, start=max(1, args.batch), **opts)
                    if row["max_batch"]:  # tokens/s at the largest batch, its peak and (hf_lsce) the op's plan
                        at = run_one(name, method, b, row["max_batch"], args.seq, args.steps, args.out_dir, device,
                                     check=False, **opts)
                        row.update({f"at_max_{k}": at.get(k) for k in ("tokens_per_s", "peak_gib", "plan")})
            except Exception as e:  # noqa: BLE001 - report, never drop silently
                row["search_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["repeat"] = rep
            runs.append(row)
            rows = merge_repeats(runs)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                               optimizer=OPTIMIZER if device == "cuda" else "adamw_torch", rows=rows), f, indent=1)
    md = (f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; the Trainer, "
          f"{'fp16' if HALF[0] == torch.float16 else 'bf16'}={device == 'cuda'}, optim={OPTIMIZER if device == 'cuda' else 'adamw_torch'}"
          f"{', LoRA r=16 (q, k, v, o), half-precision base' if args.lora else ''}; {args.steps} timed steps after 2 warm-up"
          f"\n\n{table(rows)}")
    print(md)
    with open(os.path.join(args.out_dir, "bench_trainer.md"), "w") as f:
        f.write(md + "\n")
    plot(rows, os.path.join(args.out_dir, "bench_trainer.png"))


if __name__ == "__main__":
    main()
