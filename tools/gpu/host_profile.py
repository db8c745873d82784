"""Experiment (issue 41, the op's host time at b = 0): where the ~0.8 ms above HF's loss goes, with the GPU kept busy
(``torch.cuda._sleep``) so only the host's enqueue is timed, on one pinned core. Three listings:

1. a price list of the primitives the op's call is made of (allocation, slicing, fills, descriptors, events, pinned
   copies, an empty Triton launch, an autograd.Function's apply);
2. cProfile's own time per function over the b = 0 training call (1 x 256 tokens at SmolLM2's head);
3. the whole call's host time, b = 0 and 0.1, against HF's loss in the same process.

    taskset -c 3 python tools/gpu/host_profile.py
"""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from host_overhead import _head_inputs  # noqa: E402

from hf_lsce import linear_cross_entropy  # noqa: E402


def busy_us(fn, reps=200, blocks=7, median=False):
    """Host us per call of ``fn`` with the GPU busy (best, or the median, of ``blocks``). A block's launches must stay
    well under the launch queue's depth (about a thousand) and its host time under the sleep (about 0.1 s), or the
    host waits for the GPU and the figure is the GPU's."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(blocks):
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            fn()
        per.append((time.perf_counter_ns() - t0) / reps / 1e3)
        torch.cuda.synchronize()
    return statistics.median(per) if median else min(per)


@triton.jit
def _empty8(a, b, c, d, e, f, g, h, n, BLOCK: tl.constexpr):
    pass


def prices():
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev = "cuda"
    x = torch.empty(256, 576, dtype=torch.bfloat16, device=dev)
    w = torch.empty(49152, 576, dtype=torch.bfloat16, device=dev)
    r = torch.empty(258, 49152, dtype=torch.bfloat16, device=dev)
    v = torch.empty(256, device=dev)
    o = torch.empty(1, 576, device=dev)
    pinned = torch.empty(6, dtype=torch.float64, pin_memory=True)
    vals = torch.zeros(6, dtype=torch.float64, device=dev)
    ones = r[256:257]
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    loss0 = torch.zeros((), device=dev)
    d0 = torch.ones((), device=dev)
    nan_t = torch.full((), float("nan"), device=dev)
    rowbuf = torch.empty(8, 256, device=dev)

    class Ident(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    xg = x.detach().requires_grad_()

    def toggles():
        m = torch.backends.cuda.matmul
        s = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
        m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = s

    def event():
        e = torch.cuda.Event()
        e.record()
    items = {
        "torch.empty(256, 576) bf16": lambda: torch.empty(256, 576, dtype=torch.bfloat16, device=dev),
        "torch.empty(8, 256) f32": lambda: torch.empty(8, 256, dtype=torch.float32, device=dev),
        "slice r[:256, :49152]": lambda: r[:256, :49152],
        "unpack 8 rows of an (8, n) buffer": lambda: tuple(rowbuf),
        "fill_ of 2 rows": lambda: r[256:, :49152].fill_(1.0),
        "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(x, [128, 64]),
        "4 matmul precision toggles": toggles,
        "os.environ.get": lambda: os.environ.get("TRITON_INTERPRET", "0"),
        "Event() + record": event,
        "pinned copy_ (non_blocking)": lambda: pinned.copy_(vals, non_blocking=True),
        "mm out_dtype f32 (colsum)": lambda: torch.mm(ones, w, out_dtype=torch.float32, out=o),
        "empty Triton kernel, 8 pointers": lambda: _empty8[(1,)](x, w, r, v, o, vals, x, w, 5, BLOCK=16),
        "autograd.Function apply (identity)": lambda: Ident.apply(xg),
        "torch.where(bad, nan, x) (0-d)": lambda: torch.where(bad, float("nan"), loss0),
        "torch.where(bad, NAN tensor, x) (0-d)": lambda: torch.where(bad, nan_t, loss0),
        "x.masked_fill(bad, nan) (0-d)": lambda: loss0.masked_fill(bad, float("nan")),
        "x.masked_fill_(bad, nan) (0-d)": lambda: loss0.masked_fill_(bad, float("nan")),
        "torch.where(bad, nan, x) (256)": lambda: torch.where(bad, float("nan"), v),
        "x.clone() (256)": lambda: v.clone(),
        "x.sum() / d (0-d)": lambda: v.sum() / d0,
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch.is_grad_enabled()": torch.is_grad_enabled,
        "torch.is_autocast_enabled('cuda')": lambda: torch.is_autocast_enabled("cuda"),
    }
    print("=== price list, host us per call (GPU busy, best of 7 blocks of 200)")
    for name, fn in items.items():
        print(f"{name:42s} {busy_us(fn):7.2f}", flush=True)


def mm_prices():
    """The host cost of the fused pass's three cuBLAS products at SmolLM2's head (1 x 256 tokens), as the op calls them
    (``matmul.mm_f32``, ``fused_pass._mm_once`` with its reduced-precision toggles) and without the toggles."""
    from hf_lsce.ops.fused_pass import _mm_once
    from hf_lsce.ops.matmul import mm_f32

    dev = "cuda"
    n, d, v = 256, 576, 49152
    r = torch.randn(n + 2, v, device=dev).bfloat16()
    w = torch.randn(v, d, device=dev).bfloat16()
    hs = torch.randn(n + 2, d, device=dev).bfloat16()
    dh32 = torch.empty(n, d, device=dev)
    dw = torch.empty(v, d, dtype=torch.bfloat16, device=dev)
    col = torch.empty(1, d, device=dev)
    e = torch.cuda.Event()
    loss, tw, den = torch.rand(n, device=dev), torch.rand(n, device=dev), torch.ones((), device=dev)
    items = {
        "colsum: mm_f32(ones row, W)": lambda: mm_f32(r[n:n + 1], w, col),
        "dh: mm_f32(R, W) (fp32 out)": lambda: mm_f32(r[:n], w, dh32),
        "dW: _mm_once(R^T, hs) (toggles)": lambda: _mm_once(r[:n + 2].T, hs, dw),
        "dW: torch.mm(R^T, hs, out=) (no toggles)": lambda: torch.mm(r[:n + 2].T, hs, out=dw),
        "dW: torch.mm(R^T, hs) (no out=)": lambda: torch.mm(r[:n + 2].T, hs),
        "loss.sum() / den": lambda: loss.sum() / den,
        "torch.dot(loss, tw)": lambda: torch.dot(loss, tw),
        "reused Event.record()": lambda: e.record(),
    }
    print("=== cuBLAS products and small ops, host us per call (GPU busy, best of 7 blocks of 200)")
    for name, fn in items.items():
        print(f"{name:42s} {busy_us(fn):7.2f}", flush=True)


def whole_calls():
    import torch.nn.functional as F
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.trainer_pt_utils import LabelSmoother

    h, w, y = _head_inputs("cuda")
    print("=== whole training call (forward + backward), host us per call (GPU busy, best of 7 blocks of 100)")
    for b in (0.0, 0.1):
        sm = LabelSmoother(epsilon=b)

        def hf():
            logits = F.linear(h, w)
            (sm({"logits": logits}, y, shift_labels=True) if b else ForCausalLMLoss(logits, y, w.shape[0])).backward()

        def ours():
            linear_cross_entropy(h, w, y, label_smoothing=b, shift=True).backward()
        a, o = busy_us(hf, reps=8, blocks=30), busy_us(ours, reps=8, blocks=30)
        am, om = busy_us(hf, reps=8, blocks=30, median=True), busy_us(ours, reps=8, blocks=30, median=True)
        print(f"b = {b}: best HF {a:7.1f}  hf_lsce {o:7.1f}  difference {o - a:+7.1f}; medians {am:7.1f} {om:7.1f} "
              f"{om - am:+7.1f}", flush=True)


def profile(b=0.0, iters=480):
    h, w, y = _head_inputs("cuda")

    def ours():
        linear_cross_entropy(h, w, y, label_smoothing=b, shift=True).backward()
    for _ in range(20):
        ours()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(iters // 8):
        torch.cuda._sleep(200_000_000)
        prof.enable()
        for _ in range(8):
            ours()
        prof.disable()
        torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(55)
    print(f"=== cProfile, b = {b}, {iters} calls, by own time\n" + buf.getvalue().split("\n", 6)[-1], flush=True)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(45)
    print(f"=== cProfile, b = {b}, by cumulative time\n" + buf.getvalue().split("\n", 6)[-1], flush=True)


if __name__ == "__main__":
    import hf_lsce

    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), hf_lsce.__file__, flush=True)
    if "--whole-only" in sys.argv:  # the A/B of two trees: the whole call alone
        whole_calls()
        sys.exit()
    if "--mm-only" in sys.argv:
        mm_prices()
        sys.exit()
    prices()
    whole_calls()
    profile()
