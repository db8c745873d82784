"""How much host (CPU) time does the patch add to a training step? (issue 27: SmolLM2-135M's bf16 Trainer step is
launch-bound, so host time per step, not GPU time, sets its tokens/s.)

At a batch small enough that the GPU finishes every kernel before the host has queued the next one, the wall time of
many forward+backward iterations (one synchronisation at the end) is the host's cost of queueing them. Measured for:

* the loss alone: HF's ``lm_head`` + ``ForCausalLMLoss`` (b = 0) or + the Trainer's ``LabelSmoother`` (b > 0),
  against ``linear_cross_entropy`` on the same hidden states;
* a whole step of a one-layer SmolLM2-135M configuration under bf16 autocast: stock against ``apply_lsce_patch``.

Writes $OUT/host_overhead.json and prints a table (ms of host time per iteration, median of 5 blocks).

    python benchmarks/host_overhead.py [--device cuda]
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
    args = ap.parse_args()
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
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "host_overhead.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
