"""Experiment (issue 41, the op's host time): what does each kind of launch cost the host? The GPU is kept busy
(``torch.cuda._sleep``) while a block of calls is queued, so only the host's enqueue is timed. Measured:

* Triton launches of an empty kernel with 1, 8 and 24 pointer arguments, and with 1 pointer and 23 ints;
* the fused pass's TMA logits launch (``_exp_tiles``): the first, which allocates its buffers and makes its two
  tensor descriptors, and the fix-up launch, which reuses them; the descriptors alone; one offsets-kernel launch;
* cuBLAS products through torch (bf16 and fp32 output), a few torch operations;
* the op's whole forward+backward and HF's loss (b = 0) at SmolLM2's head, 256 tokens.

Best of 7 blocks (the median beside it); run on one pinned core:

    taskset -c 3 python tools/gpu/launch_cost.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEV = "cuda"


@triton.jit
def k1(A, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def k8(A, B, C, D, E, F, G, H, n, BLOCK: tl.constexpr):
    pass


@triton.jit
def k24(A, B, C, D, E, F, G, H, A2, B2, C2, D2, E2, F2, G2, H2, A3, B3, C3, D3, E3, F3, G3, H3, n,
        BLOCK: tl.constexpr):
    pass


@triton.jit
def k1i23(A, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15, n16, n17, n18, n19, n20, n21, n22,
          n23, BLOCK: tl.constexpr):
    pass


def host_us(name, fn, k=100):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(7):
        torch.cuda._sleep(200_000_000)  # the GPU stays busy while the block is queued
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        res.append((time.perf_counter() - t0) / k * 1e6)
        torch.cuda.synchronize()
    print(f"{name:55s} {min(res):7.1f} us (median {statistics.median(res):7.1f})", flush=True)


def main():
    from transformers.loss.loss_utils import ForCausalLMLoss

    from hf_lsce import linear_cross_entropy
    from hf_lsce.ops import fused_pass as fp
    from hf_lsce.ops.config import forward_config
    from hf_lsce.ops.matmul import mm_f32

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; host us per call")
    x = [torch.empty(256, device=DEV) for _ in range(24)]
    host_us("Triton, empty kernel, 1 pointer", lambda: k1[(1,)](x[0], 256, BLOCK=64))
    host_us("Triton, empty kernel, 8 pointers", lambda: k8[(1,)](*x[:8], 256, BLOCK=64))
    host_us("Triton, empty kernel, 24 pointers", lambda: k24[(1,)](*x, 256, BLOCK=64))
    host_us("Triton, empty kernel, 1 pointer + 23 ints", lambda: k1i23[(1,)](x[0], *range(1000, 1023), BLOCK=64))
    n, d, v = 256, 576, 49152
    h = torch.randn(n + 2, d, device=DEV).bfloat16()
    w = (torch.randn(v, d, device=DEV) * 0.02).bfloat16()
    r = torch.empty(n + 2, fp.chunk_rows(n, v)[0], device=DEV, dtype=torch.bfloat16)[:, :v].fill_(0.5)
    cfg = forward_config(h.dtype, h.device)
    c = torch.zeros(n, device=DEV)
    st, descs = fp._exp_tiles(cfg, h[:n], w, None, c, r[:n], False)
    host_us("_exp_tiles, first launch (buffers, descriptors)",
            lambda: fp._exp_tiles(cfg, h[:n], w, None, c, r[:n], False))
    host_us("_exp_tiles, fix-up launch (reused)",
            lambda: fp._exp_tiles(cfg, h[:n], w, None, c, r[:n], False, bufs=st, descs=descs))
    from triton.tools.tensor_descriptor import TensorDescriptor
    host_us("two TensorDescriptor.from_tensor", lambda: (TensorDescriptor.from_tensor(h, [cfg.block_n, cfg.block_d]),
                                                         TensorDescriptor.from_tensor(w, [cfg.block_v, cfg.block_d])))
    y = torch.randint(0, v, (n,), device=DEV)
    sz, zy = torch.empty(n, device=DEV), torch.empty(n, device=DEV)
    sums = fp._column_sums(w, None)
    host_us("_row_offsets (one Triton launch, 11 pointers)",
            lambda: fp._row_offsets(h[:n], w, None, sums, y, c, sz, zy))
    o16, o32 = torch.empty(n, d, device=DEV).bfloat16(), torch.empty(n, d, device=DEV)
    dw = torch.empty(v, d, device=DEV).bfloat16()
    host_us("torch.mm bf16 (N x V)(V x D)", lambda: torch.mm(r[:n], w, out=o16))
    host_us("mm_f32 (out_dtype fp32) (N x V)(V x D)", lambda: mm_f32(r[:n], w, o32))
    host_us("_mm_once dW (V x N+2)(N+2 x D), exact reduction", lambda: fp._mm_once(r.T, h, dw))
    host_us("F.linear bf16 (HF's logits)", lambda: F.linear(h[:n], w))
    host_us("torch.ones(1, V)", lambda: torch.ones(1, v, device=DEV, dtype=torch.bfloat16))
    host_us("torch.empty(N, D)", lambda: torch.empty(n, d, device=DEV))
    host_us("x.sum() / y[0]", lambda: c.sum() / sz[0])
    # W's column sums in fp32 (the offsets' and dh's uniform term), host and GPU time, SmolLM2's and Gemma-3's heads
    for vv, dd in ((v, d), (262144, 640)):
        wv = (torch.randn(vv, dd, device=DEV) * 0.02).bfloat16()
        ones_row, ones_col, ones8 = (torch.ones(1, vv, device=DEV).bfloat16(), torch.ones(vv, 1, device=DEV).bfloat16(),
                                     torch.ones(8, vv, device=DEV).bfloat16())
        out_r, out_c, out8 = (torch.empty(1, dd, device=DEV), torch.empty(dd, 1, device=DEV),
                              torch.empty(8, dd, device=DEV))
        for name, fn in ((f"colsum {vv}x{dd}: mm_f32(ones(1, V), W) (the op's)", lambda: mm_f32(ones_row, wv, out_r)),
                         (f"colsum {vv}x{dd}: mm_f32(W^T, ones(V, 1))", lambda: mm_f32(wv.T, ones_col, out_c)),
                         (f"colsum {vv}x{dd}: mm_f32(ones(8, V), W)", lambda: mm_f32(ones8, wv, out8)),
                         (f"colsum {vv}x{dd}: W.sum(0, dtype=fp32)", lambda: wv.sum(0, dtype=torch.float32))):
            host_us(name, fn)
            s_, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s_.record()
            for _ in range(20):
                fn()
            e_.record()
            e_.synchronize()
            print(f"{'':55s} GPU {s_.elapsed_time(e_) / 20 * 1e3:7.1f} us", flush=True)
    hh = (torch.randn(1, n, d, device=DEV) * 0.5).bfloat16().requires_grad_()
    ww = w.clone().requires_grad_()
    yy = torch.randint(0, v, (1, n), device=DEV)
    host_us("the op, forward+backward, b = 0", lambda: linear_cross_entropy(hh, ww, yy, shift=True).backward(), k=40)
    host_us("HF's loss (F.linear + ForCausalLMLoss), forward+backward",
            lambda: ForCausalLMLoss(F.linear(hh, ww), yy, v).backward(), k=40)


if __name__ == "__main__":
    main()
