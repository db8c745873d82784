"""Experiment (issue 41, the frozen head's last 0.01 x at Gemma-3-270m): can W's column sums (one read of W, 125 us at
Gemma-3-270m's head) hide behind the fused logits kernel on a second CUDA stream?

A frozen head (LoRA), b = 0.1, N = 8,192, realistic inputs (benchmarks/real_inputs.py); do_bench medians, ms:

* op: ``linear_cross_entropy`` as it is;
* no column sums: ``fused_pass._column_sums`` returns precomputed sums (no matmul): the most any change can save;
* side stream: the same, plus the real column-sum matmul launched on a second stream at the start of the pass and
  joined at its end (what a design with sampled offsets and the exact sums on a side stream would cost);
* the column sums alone; the two-matmul floor (logits, dh).

The three variants run interleaved, four times each; the table gives the best of each.

    python tools/gpu/colsum_overlap.py
"""
import sys

import torch
import triton

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import hf_lsce.ops.fused_pass as fp  # noqa: E402
from hf_lsce import linear_cross_entropy  # noqa: E402
from real_inputs import fitted_params, realistic_batch  # noqa: E402

SHAPES = {"gemma3-270m": (8192, 640, 262144), "gemma2-2b": (8192, 2304, 256000), "llama3-8b": (8192, 4096, 128256),
          "smollm2-135m": (8192, 576, 49152)}


REPEATS = 4


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median")


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    real_sums, real_pass = fp._column_sums, fp.triton_fused_columns
    side = torch.cuda.Stream()
    print("| shape | op | no column sums | side stream | column sums alone | floor | op / floor | best / floor | "
          "side / floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, d, v) in SHAPES.items():
        h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
        hh = h.detach().clone().requires_grad_()
        w = w.detach()
        cached = real_sums(w, None)
        scratch = torch.empty(1, d, dtype=torch.float32, device="cuda")
        ones = torch.ones(1, v, dtype=w.dtype, device="cuda")

        def step():
            hh.grad = None
            linear_cross_entropy(hh, w, y, label_smoothing=0.1).backward()

        def variants():
            op = bench(step)
            fp._column_sums = lambda weight, bias, ones_=None: cached
            try:
                best = bench(step)

                def with_side(*a, **k):
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        torch.mm(ones, w, out_dtype=torch.float32, out=scratch)
                    out = real_pass(*a, **k)
                    torch.cuda.current_stream().wait_stream(side)
                    return out
                fp.triton_fused_columns = with_side
                try:
                    over = bench(step)
                finally:
                    fp.triton_fused_columns = real_pass
            finally:
                fp._column_sums = real_sums
            return op, best, over
        runs = [variants() for _ in range(REPEATS)]  # interleaved; the first of a shape ran slow in a first try
        op, best, over = (min(r[i] for r in runs) for i in range(3))
        print(f"  ({name}: every run, op / none / side: " + "; ".join(f"{a:.3f} / {b:.3f} / {c:.3f}" for a, b, c in runs)
              + ")", flush=True)
        alone = bench(lambda: torch.mm(ones, w, out_dtype=torch.float32, out=scratch))
        logits = torch.empty(n, v, dtype=w.dtype, device="cuda")
        dh = torch.empty(n, d, dtype=w.dtype, device="cuda")
        hb = h.detach()

        def floor():
            torch.mm(hb, w.T, out=logits)
            torch.mm(logits, w, out=dh)
        fl = bench(floor)
        print(f"| {name} | {op:.3f} | {best:.3f} | {over:.3f} | {alone:.3f} | {fl:.3f} | {op / fl:.3f} | "
              f"{best / fl:.3f} | {over / fl:.3f} |", flush=True)
        del logits, dh, h, w, hh, cached
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
