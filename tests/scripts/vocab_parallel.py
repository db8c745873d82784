"""Run by torch.distributed.run with 2 gloo processes: the vocabulary-parallel op vs an fp64 oracle.

Each rank holds its (uneven) shard of the LM head; the loss and gradients must equal those of
F.cross_entropy on the full materialised fp64 logits. Writes one JSON line of errors per case.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_lsce import linear_cross_entropy

out_path, backend = sys.argv[1], sys.argv[2]
dev = sys.argv[3] if len(sys.argv) > 3 else "cpu"  # "cuda": NCCL, compiled Triton kernels
dist.init_process_group("nccl" if dev == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if dev == "cuda":
    torch.cuda.set_device(rank)
N, D, V = 23, 16, 37
bounds = [0, 19, 37]  # uneven shards: 19 + 18 rows


def oracle(h, w, bias, y, b, softcap, reduction, num_items):
    h, w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    bb = bias.detach().double().requires_grad_() if bias is not None else None
    z = h @ w.T + (bb if bb is not None else 0)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    if torch.is_tensor(b):  # per-token smoothing: (1 - b) nll + b * uniform
        lp = torch.log_softmax(z, -1)
        valid = y != -100
        nll = -lp.gather(1, y.clamp(min=0)[:, None])[:, 0]
        per = torch.where(valid, (1 - b.double()) * nll - b.double() * lp.mean(-1), torch.zeros_like(nll))
        loss = per.sum() / valid.sum() if reduction == "mean" else per.sum()
    else:
        loss = F.cross_entropy(z, y, label_smoothing=b, reduction="sum" if num_items else reduction)
        if num_items:
            loss = loss / num_items
    if loss.dim():
        loss.backward(torch.arange(1, loss.numel() + 1, dtype=loss.dtype, device=loss.device))
    else:
        loss.backward()
    return loss.detach(), h.grad, w.grad, bb.grad if bb is not None else None


results = []
cases = [dict(b=0.0), dict(b=0.1), dict(b=0.1, softcap=2.0), dict(b=0.3, bias=True), dict(b="per_token"),
         dict(b=0.1, reduction="sum"), dict(b=0.1, reduction="none"), dict(b=0.2, num_items=31),
         dict(b=0.1, softcap=3.0, bias=True, reduction="none"),
         # half precision with a bias: the backends return dh / dW in the inputs' dtype and db in fp32
         dict(b=0.3, bias=True, dtype="bf16"), dict(b=0.1, bias=True, dtype="fp16", softcap=3.0)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"bf16": 2e-2, "fp16": 4e-3}  # rounding of the inputs and of the returned gradients
for i, case in enumerate(cases):
    g = torch.Generator().manual_seed(i)
    h = torch.randn(N, D, generator=g) * 2
    w = torch.randn(V, D, generator=g) * 0.5
    bias = torch.randn(V, generator=g) if case.get("bias") else None
    y = torch.randint(0, V, (N,), generator=g)
    y[::5] = -100
    dt = DTYPES.get(case.get("dtype"))
    if dt is not None:  # the oracle sees the same rounded values
        h, w = h.to(dt).float(), w.to(dt).float()
        bias = bias.to(dt).float() if bias is not None else None
    b = torch.rand(N, generator=g) * 0.5 if case["b"] == "per_token" else case["b"]
    reduction, softcap, num_items = case.get("reduction", "mean"), case.get("softcap"), case.get("num_items")
    lo, hi = bounds[rank], bounds[rank + 1]
    hs = h.clone().to(dt or torch.float32).requires_grad_()
    ws = w[lo:hi].clone().to(dt or torch.float32).requires_grad_()
    bs = bias[lo:hi].clone().to(dt or torch.float32).requires_grad_() if bias is not None else None
    if dev == "cuda":
        hs, ws, y = hs.detach().cuda().requires_grad_(), ws.detach().cuda().requires_grad_(), y.cuda()
        bs = bs.detach().cuda().requires_grad_() if bs is not None else None
        b = b.cuda() if torch.is_tensor(b) else b
    loss = linear_cross_entropy(hs, ws, y, bias=bs, label_smoothing=b, softcap=softcap, reduction=reduction,
                                num_items_in_batch=num_items, backend=backend, process_group=dist.group.WORLD)
    if loss.dim():
        loss.backward(torch.arange(1, loss.numel() + 1, dtype=loss.dtype, device=loss.device))
    else:
        loss.backward()
    y, b = y.cpu(), b.cpu() if torch.is_tensor(b) else b
    ref_loss, ref_dh, ref_dw, ref_db = oracle(h, w, bias, y, b, softcap, reduction, num_items)
    rel = lambda a, r: float((a.detach().cpu().double() - r).norm() / r.norm().clamp_min(1e-30))  # noqa: E731
    results.append(dict(case=str(case), tol=TOLERANCE.get(case.get("dtype"), 1e-5),
                        loss=rel(loss.detach(), ref_loss), dh=rel(hs.grad, ref_dh),
                        dw=rel(ws.grad, ref_dw[lo:hi]),
                        db=rel(bs.grad, ref_db[lo:hi]) if bias is not None else 0.0))
with open(f"{out_path}.{rank}", "w") as f:
    json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
# Skip interpreter teardown: gloo's threads sometimes abort there ("terminate called without an active
# exception") after every result is written, which would fail the run for nothing.
sys.stdout.flush()
os._exit(0)
