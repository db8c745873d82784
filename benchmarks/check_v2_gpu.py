"""GPU checks of kernel v2 (issue 27), one process: prints JSON lines and writes $OUT/check_v2_gpu.json.

1. The training paths (fused, one-pass, two-pass, the default) against fp64 on materialised logits: bf16, ragged and
   aligned vocabularies (TMA and pointer kernels), soft-cap, bias, per-token b, a tensor num_items_in_batch.
2. No host synchronisation: a training call of the op (each path) and its backward under
   ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call.
3. The asynchronous target check on CUDA: a bad target gives a NaN loss and no gradient, the next call raises the
   ValueError, and the call after that is exact.
4. ``memory="auto"``'s free-memory reading equals the driver's free memory plus torch's reserved-but-unallocated bytes.

    python benchmarks/check_v2_gpu.py
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import hf_lsce.ops.config as config  # noqa: E402
from hf_lsce import linear_cross_entropy  # noqa: E402
from hf_lsce.ops import checks  # noqa: E402


def ref64(h, w, bias, y, b, cap, num_items):
    hh, ww = h.double().requires_grad_(), w.double().requires_grad_()
    bb = bias.double().requires_grad_() if bias is not None else None
    z = hh @ ww.T + (bb if bb is not None else 0)
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    logp = torch.log_softmax(z, -1)
    valid = y >= 0
    tok = -(1 - b.double()) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - b.double() * logp.mean(-1)
    loss = torch.where(valid, tok, 0.0).sum() / num_items
    loss.backward()
    return loss.detach(), hh.grad, ww.grad, bb.grad if bb is not None else None


def rel(a, r):
    return float((a.double() - r).norm() / r.norm().clamp_min(1e-300))


def main():
    out_dir = os.environ.get("OUT", "gpu_out")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for n, d, v, cap, with_bias in ((1500, 640, 32768, None, False), (1500, 576, 50257, 30.0, True),
                                    (777, 2304, 40000, None, False), (1500, 640, 32771, None, True)):
        w = (torch.randn(v, d, device=dev, generator=g) / d ** 0.5).bfloat16()
        h = (torch.randn(n, d, device=dev, generator=g) * 3).bfloat16()
        y = torch.randint(0, v, (n,), device=dev, generator=g)
        y[::7] = -100
        bias = (torch.randn(v, device=dev, generator=g) * 0.1).bfloat16() if with_bias else None
        b = torch.rand(n, device=dev, generator=g) * 0.2
        items = (y >= 0).sum() + 5
        ref = ref64(h, w, bias, y, b, cap, float(items))
        for path in ("fused", "one-pass", "two-pass", None):
            config.TRAIN_PATH = path
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            bb = bias.clone().requires_grad_() if bias is not None else None
            try:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                loss = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=b, softcap=cap, reduction="sum",
                                            num_items_in_batch=items)
                loss.backward()
                sync_free = True
            except RuntimeError as e:
                sync_free = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if sync_free is not True:  # run again without the debug mode, for the numbers
                hh.grad = ww.grad = None
                if bb is not None:
                    bb.grad = None
                loss = linear_cross_entropy(hh, ww, y, bias=bb, label_smoothing=b, softcap=cap, reduction="sum",
                                            num_items_in_batch=items)
                loss.backward()
            row = dict(check="paths", N=n, D=d, V=v, softcap=cap, bias=with_bias, path=path or "default",
                       sync_free=sync_free, loss_err=abs(float(loss) - float(ref[0])) / abs(float(ref[0])),
                       dh_err=rel(hh.grad, ref[1]), dw_err=rel(ww.grad, ref[2]),
                       db_err=rel(bb.grad, ref[3]) if bb is not None else None)
            rows.append(row)
            print(json.dumps(row), flush=True)
        # torch in bf16 (HF's path) for scale
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        z = (hh @ ww.T + (bias if bias is not None else 0)).float()
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        logp = torch.log_softmax(z, -1)
        tok = -(1 - b) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - b * logp.mean(-1)
        (torch.where(y >= 0, tok, 0.0).sum() / items).backward()
        row = dict(check="paths", N=n, D=d, V=v, softcap=cap, bias=with_bias, path="torch bf16 logits",
                   dh_err=rel(hh.grad, ref[1]), dw_err=rel(ww.grad, ref[2]))
        rows.append(row)
        print(json.dumps(row), flush=True)
    config.TRAIN_PATH = None

    # asynchronous target check
    n, d, v = 1024, 640, 32768
    w = (torch.randn(v, d, device=dev, generator=g) / d ** 0.5).bfloat16().requires_grad_()
    h = (torch.randn(n, d, device=dev, generator=g) * 3).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    bad = y.clone()
    bad[5] = v + 3
    loss = linear_cross_entropy(h, w, bad, label_smoothing=0.1)
    loss.backward()
    nan_loss = bool(torch.isnan(loss))
    zero_grad = float(h.grad.abs().max()) == 0 and float(w.grad.float().abs().max()) == 0
    torch.cuda.synchronize()
    try:
        linear_cross_entropy(h.detach(), w.detach(), y, label_smoothing=0.1)
        raised = None
    except ValueError as e:
        raised = str(e)[:160]
    ok_after = bool(torch.isfinite(linear_cross_entropy(h.detach(), w.detach(), y, label_smoothing=0.1)))
    checks.raise_pending_errors()
    row = dict(check="async targets", nan_loss=nan_loss, zero_grad=zero_grad, next_call_raised=raised,
               call_after_is_finite=ok_after)
    rows.append(row)
    print(json.dumps(row), flush=True)

    # memory="auto"'s free-memory reading against torch's public counters (with a cached, unused block)
    from hf_lsce.ops.linear_cross_entropy import free_cuda_memory

    del loss
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    unused = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    got = free_cuda_memory(h.device)
    row = dict(check="free_cuda_memory", bytes=got, expected=free + unused, unused_cache=unused,
               equal=got == free + unused)
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(os.path.join(out_dir, "check_v2_gpu.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
