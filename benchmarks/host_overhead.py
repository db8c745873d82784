"""How much host (CPU) time does the patch add to a training step? (issue 27: SmolLM2-135M's bf16 Trainer step is
launch-bound, so host time per step, not GPU time, sets its tokens/s.)

At a batch small enough that the GPU finishes every kernel before the host has queued the next one, the wall time of
many forward+backward iterations (one synchronisation at the end) is the host's cost of queueing them. Measured for:

* the loss alone: HF's ``lm_head`` + ``ForCausalLMLoss`` (b = 0) or + the Trainer's ``LabelSmoother`` (b > 0),
  against ``linear_cross_entropy`` on the same hidden states;
* a whole step of a one-layer SmolLM2-135M configuration under bf16 autocast: stock against ``apply_lsce_patch``.

Writes $OUT/host_overhead.json and prints a table (ms of host time per iteration, median of 5 blocks).

    python benchmarks/host_overhead.py [--device cuda]

``--lengths L1,L2,...`` asks another question: what does a batch of a length not met before cost the host? (A
framework that pads each batch to its longest row, as LLaMA-Factory does, meets new lengths for many steps.) For each
length in turn, one forward and one backward of the op at Gemma-3-270m's head (8 rows, D = 640, V = 262,144, bf16; a
frozen head, as LoRA's, and a trainable one; b = 0 and 0.1), each call started from an idle GPU: the host time of
each, and the Triton kernels it compiled (Triton's compile hook: one entry per new specialisation; Triton specialises
an integer argument on its divisibility by 16 and on being 1). Triton's cache starts empty (a fresh
``TRITON_CACHE_DIR``), as in a new environment; a kernel compiled once is then in the disk cache for later processes.
Writes $OUT/host_overhead_lengths.json.

    python benchmarks/host_overhead.py --lengths 640,641,650,651,700,703,640,641
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def per_iter_ms(fn, device, iters, blocks=5, warmup=10):
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    out = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(out)


def _head_inputs(device, n=256, d=576, v=49152):
    """(hidden, weight, targets) at SmolLM2's head (bf16 on CUDA), with gradients wanted."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    h = (torch.randn(1, n, d, generator=g) * 0.5).to(device, dt).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.02).to(device, dt).requires_grad_()
    return h, w, torch.randint(0, v, (1, n), generator=g).to(device)


def loss_only(device, b, iters):
    import torch.nn.functional as F
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.trainer_pt_utils import LabelSmoother

    from hf_lsce import linear_cross_entropy

    h, w, y = _head_inputs(device)
    v = w.shape[0]
    smoother = LabelSmoother(epsilon=b)

    def hf():
        logits = F.linear(h, w)
        (smoother({"logits": logits}, y, shift_labels=True) if b else ForCausalLMLoss(logits, y, v)).backward()

    def ours():
        linear_cross_entropy(h, w, y, label_smoothing=b, shift=True).backward()
    return {"hf": per_iter_ms(hf, device, iters), "hf_lsce": per_iter_ms(ours, device, iters)}


def profile_op(device, iters, n=256, paths=(None,)):
    """cProfile of the op's forward+backward calls (host side), top functions by own time and by cumulative time, at
    ``n`` tokens, for each training path in ``paths`` (None: the default's choice). Each call starts with the GPU
    idle (a synchronisation outside the profiled span), so the host's queueing cost is measured per call (printed:
    the median) and a host call that waits on the GPU shows as a large own time."""
    import cProfile
    import io
    import pstats

    import hf_lsce.ops.config as config
    from hf_lsce import linear_cross_entropy

    h, w, y = _head_inputs(device, n=n)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for path in paths:
        config.TRAIN_PATH = path
        for b in (0.0, 0.1):
            def ours():
                linear_cross_entropy(h, w, y, label_smoothing=b, shift=True).backward()
            for _ in range(10):
                ours()
            prof = cProfile.Profile()
            host = []
            for _ in range(iters):
                sync()
                prof.enable()
                t0 = time.perf_counter()
                ours()
                host.append((time.perf_counter() - t0) * 1e3)
                prof.disable()
            sync()
            print(f"=== {n} tokens, path {path or 'default'}, b = {b}: host ms per call from an idle GPU, median "
                  f"{statistics.median(host):.3f} (min {min(host):.3f}, max {max(host):.3f})", flush=True)
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(25 if key == "tottime" else 35)
                print(f"--- by {key}, {iters} calls\n" + buf.getvalue().split("\n", 6)[-1], flush=True)
    config.TRAIN_PATH = None


def whole_step(device, b, iters):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.trainer_pt_utils import LabelSmoother

    from hf_lsce import apply_lsce_patch

    sys.path.insert(0, HERE)
    from bench_trainer import CONFIGS

    spec = dict(CONFIGS["smollm2-135m-config"], num_hidden_layers=1)
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    res = {}
    for method in ("hf", "hf_lsce"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).to(device)
        if method == "hf_lsce":
            apply_lsce_patch(model, label_smoothing=b)
        ids = torch.randint(0, model.config.vocab_size, (1, 256), device=device)
        smoother = LabelSmoother(epsilon=b)

        def step():
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                if method == "hf" and b:
                    loss = smoother(model(input_ids=ids), ids, shift_labels=True)
                else:
                    loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        res[method] = per_iter_ms(step, device, iters)
        del model
    return res


def new_lengths(device, lengths, batch=8, dim=640, vocab=262144):
    """Rows (head, b, call k, length, host ms of the forward and of the backward, kernels each compiled) of the op's
    calls over batches of ``lengths``, each from an idle GPU (see the module's docstring)."""
    import triton

    from hf_lsce import linear_cross_entropy

    compiled: list[str] = []

    def hook(*args, **kwargs):  # Triton calls it before each compile; False: compile as usual
        fn = kwargs.get("fn")
        compiled.append(getattr(fn, "name", None) or str(fn))
        return False

    knobs = triton.knobs.runtime
    before, knobs.jit_cache_hook = knobs.jit_cache_hook, hook
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    try:
        for frozen in (True, False):
            w = (torch.randn(vocab, dim, generator=g) * 0.02).to(device, dt).requires_grad_(not frozen)
            for b in (0.0, 0.1):
                for k, length in enumerate(lengths):
                    h = (torch.randn(batch, length, dim, generator=g) * 0.5).to(device, dt).requires_grad_()
                    y = torch.randint(0, vocab, (batch, length), generator=g).to(device)
                    sync()
                    c0, t0 = len(compiled), time.perf_counter()
                    loss = linear_cross_entropy(h, w, y, label_smoothing=b, shift=True)
                    c1, t1 = len(compiled), time.perf_counter()
                    loss.backward()
                    c2, t2 = len(compiled), time.perf_counter()
                    sync()
                    rows.append(dict(head="frozen" if frozen else "trainable", b=b, call=k, length=length,
                                     tokens=batch * length, forward_ms=(t1 - t0) * 1e3, backward_ms=(t2 - t1) * 1e3,
                                     forward_compiled=compiled[c0:c1], backward_compiled=compiled[c1:c2]))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        knobs.jit_cache_hook = before
    return rows


def lengths_table(rows) -> str:
    lines = ["| head | b | call | length (rows x length tokens) | forward host ms | kernels compiled | backward host ms "
             "| kernels compiled |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['head']} | {r['b']:g} | {r['call']} | {r['length']} ({r['tokens']}) | {r['forward_ms']:.2f} "
                     f"| {', '.join(r['forward_compiled']) or '-'} | {r['backward_ms']:.2f} | "
                     f"{', '.join(r['backward_compiled']) or '-'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--cprofile", action="store_true",
                    help="also: where the op's host time goes (cProfile over its loss-only loop, top functions)")
    ap.add_argument("--cprofile-only", action="store_true", help="only the cProfile listing")
    ap.add_argument("--tokens", type=int, default=256, help="tokens of the cProfile'd loop")
    ap.add_argument("--paths", default="", help="training paths to force in the cProfile'd loop, comma-separated "
                    "(fused, two-pass, one-pass; default: the op's own choice)")
    ap.add_argument("--lengths", default="",
                    help="comma-separated batch lengths: the host cost of each new length (see the docstring); "
                         "only this is measured")
    args = ap.parse_args()
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    if args.lengths:
        import tempfile

        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")  # (read at each compile)
        rows = new_lengths(args.device, [int(x) for x in args.lengths.split(",")])
        print(lengths_table(rows))
        with open(os.path.join(out, "host_overhead_lengths.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "torch": torch.__version__, "triton": __import__("triton").__version__, "rows": rows}, f,
                      indent=1)
        return
    paths = [p or None for p in args.paths.split(",")]
    if args.cprofile_only:
        profile_op(args.device, args.iters, args.tokens, paths)
        return
    rows = []
    for what, fn in (("loss only (N = 256, D = 576, V = 49,152)", loss_only),
                     ("one-layer SmolLM2 step (1 x 256, bf16 autocast)", whole_step)):
        for b in (0.0, 0.1):
            r = fn(args.device, b, args.iters)
            rows.append(dict(what=what, b=b, **r))
            print(json.dumps(rows[-1]), flush=True)
    if args.cprofile:
        profile_op(args.device, args.iters, args.tokens, paths)
    lines = ["| what | b | HF, ms/iter (host) | hf_lsce | difference |", "|---|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['b']} | {r['hf']:.3f} | {r['hf_lsce']:.3f} | {r['hf_lsce'] - r['hf']:+.3f} |"
              for r in rows]
    print("\n".join(lines))
    with open(os.path.join(out, "host_overhead.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
