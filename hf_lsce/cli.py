"""The ``hf-lsce`` command line."""
from __future__ import annotations

import argparse
import json
import sys
import time


def _cmd_check(args) -> int:
    """Run the fused op against materialised logits on this machine and print the comparison."""
    import torch
    import torch.nn.functional as F

    from .ops import linear_cross_entropy

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    n, d, v = args.tokens, args.hidden_size, args.vocab_size
    w = (torch.randn(v, d, generator=g) / d ** 0.5).to(dev, dtype)
    y = torch.randint(0, v, (n,), generator=g).to(dev)
    h = (3 * torch.randn(n, d, generator=g)).to(dev, dtype)
    rows = []
    for name in ("fused", "materialised"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        if name == "fused":
            loss = linear_cross_entropy(hh, ww, y, label_smoothing=args.label_smoothing)
        else:
            loss = F.cross_entropy((hh @ ww.T).float(), y, label_smoothing=args.label_smoothing)
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda" else float("nan")
        rows.append(dict(method=name, loss=float(loss), seconds=dt, peak_extra_mib=peak,
                         grad_hidden=hh.grad.float(), grad_weight=ww.grad.float()))
    f, m = rows
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    backend = "Triton kernels" if dev.type == "cuda" else "chunked torch fallback (no CUDA device)"
    print(f"hf-lsce check: N={n} D={d} V={v} {args.dtype} b={args.label_smoothing} on {dev} [{backend}]")
    print(f"{'method':<14}{'loss':>12}{'time (s)':>11}{'peak extra MiB':>16}")
    for r in rows:
        print(f"{r['method']:<14}{r['loss']:>12.6f}{r['seconds']:>11.3f}{r['peak_extra_mib']:>16.1f}")
    print(f"relative difference: loss {abs(f['loss'] - m['loss']) / abs(m['loss']):.2e}, "
          f"dL/dh {rel(f['grad_hidden'], m['grad_hidden']):.2e}, dL/dW {rel(f['grad_weight'], m['grad_weight']):.2e}")
    return 0


def _cmd_run(args) -> int:
    from .run import run_script

    run_script(args.script, args.script_args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-lsce", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="compare the fused op with materialised logits on this machine")
    c.add_argument("--tokens", type=int, default=2048)
    c.add_argument("--hidden-size", type=int, default=512)
    c.add_argument("--vocab-size", type=int, default=32000)
    c.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="fp32")
    c.add_argument("--label-smoothing", type=float, default=0.1)
    c.add_argument("--device", default=None)
    c.set_defaults(func=_cmd_check)
    r = sub.add_parser("run", help="run an unmodified HF/TRL training script with the patch applied",
                       description="Patch every supported model class, then run SCRIPT with ARGS; its "
                                   "--label_smoothing_factor drives the fused op.")
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    r.set_defaults(func=_cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
