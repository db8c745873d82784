"""The chunked torch computation: the CPU fallback, the test oracle, and the op on GPUs where the fused pass does not
run (fp32 and fp64 inputs, GPUs whose Triton dots are not tensor-core MMA, soft-caps above its limit).

One function, ``torch_pass``: rows go ``rows`` at a time, so at most two chunks of ``rows x V`` logits exist (fp32,
fp64 for fp64 inputs; half-precision inputs are upcast, as the kernels' fp32 accumulators do), never the whole
``N x V`` matrix. From each chunk's logits it takes the per-token statistics, and where a per-token weight ``grad``
is given the gradients too, from the same logits: the training call's three matmuls (logits, dh, dW); given the lse
(a recomputing backward) the statistics are skipped.
"""
from __future__ import annotations

import torch

# Target size of one chunk of logits (elements) where no budget sets it (the CPU): 2**24, 64 MiB in fp32.
_CHUNK_ELEMENTS = 1 << 24


def chunk_rows(n: int, v: int, chunk_elements: int | None = None) -> int:
    """Rows per chunk so that one chunk of logits holds about ``chunk_elements`` values (default
    ``_CHUNK_ELEMENTS``, read at call time)."""
    if chunk_elements is None:
        chunk_elements = _CHUNK_ELEMENTS
    return max(1, min(n, chunk_elements // max(v, 1)))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def torch_pass(hidden, weight, bias, targets, softcap, rows: int | None = None, *, lse=None, grad=None,
               smoothing=None, z_loss: float = 0.0, extra=None, need_dh=True, need_dw=True, need_db=True,
               vocab: int | None = None, need_stats=True):
    """Per-token statistics ``(lse, target logit, sum of logits, argmax, entropy)`` of 2-D ``hidden`` (N, D) (not
    computed where ``lse`` is given: None), and with ``grad`` (N,) the gradients ``(dh, dw, db)`` of
    ``sum_n grad_n loss_n + extra_n lse_n`` (the z-loss ``z_loss lse^2`` in the loss; ``smoothing`` per token);
    ``rows`` rows at a time (None: ``chunk_rows``). ``targets`` (N,) int64 may hold any value outside [0, V) for
    ignored tokens (target logit 0, no target term); ``vocab``: the whole vocabulary where ``weight`` is a shard of it
    (the uniform term's ``V``). Float outputs in the compute dtype (fp32, fp64 for fp64);
    dh, dw, db None where not needed; the entropy zeros unless ``need_stats``."""
    n, v = hidden.shape[0], weight.shape[0]
    cd = compute_dtype(hidden)
    dev = hidden.device
    w = weight.to(cd)
    b = bias.to(cd) if bias is not None else None
    stats = None
    if lse is None:
        lse = torch.empty(n, dtype=cd, device=dev)
        zy, sz, ent = torch.zeros(3, n, dtype=cd, device=dev)
        am = torch.empty(n, dtype=torch.int64, device=dev)
        stats = (lse, zy, sz, am, ent)
    # without a cap, sum_v z_nv = h_n . sum_v W_v (+ sum_v bias_v): a product per chunk, not a pass over its logits
    w_sum = w.sum(0) if stats is not None and softcap is None else None
    b_sum = b.sum() if w_sum is not None and b is not None else 0.0
    train = grad is not None
    dh = torch.empty(n, weight.shape[1], dtype=cd, device=dev) if train and need_dh else None
    dw = torch.zeros(weight.shape, dtype=cd, device=dev) if train and need_dw else None
    db = torch.zeros(v, dtype=cd, device=dev) if train and need_db and bias is not None else None
    step = min(n, rows or chunk_rows(n, v))
    # the two chunks of logits (z, then exp(z - m) and the gradient G in p): allocated once, reused by every chunk
    zbuf, pbuf = torch.empty(2, step, v, dtype=cd, device=dev)
    for s in range(0, n, step):
        e = min(n, s + step)
        h = hidden[s:e].to(cd)
        z = torch.mm(h, w.T, out=zbuf[:e - s])
        if b is not None:
            z += b
        if softcap is not None:
            z.div_(softcap).tanh_().mul_(softcap)
        y = targets[s:e]
        valid = (y >= 0) & (y < v)
        yc = y.clamp(0, v - 1)[:, None]
        p = pbuf[:e - s]
        if stats is not None:
            # everything from the logits shifted by the row maximum: entropy = log s - sum e (z - m) / s with
            # e = exp(z - m), s = sum e (through lse = m + log s instead, large logits lose digits)
            zmax, am[s:e] = z.max(-1)
            zy[s:e] = torch.where(valid, z.gather(1, yc)[:, 0], 0.0)
            sz[s:e] = z.sum(-1) if w_sum is None else h @ w_sum + b_sum
            z -= zmax[:, None]
            torch.exp(z, out=p)
            s_c = p.sum(-1)
            lse[s:e] = zmax + torch.log(s_c)
            if need_stats:
                ent[s:e] = torch.log(s_c) - (p[:, None, :] @ z[:, :, None])[:, 0, 0] / s_c
            if not train:
                continue
            if softcap is not None:
                z += zmax[:, None]  # (the capped logits back, for the cap's derivative)
        elif train:
            torch.sub(z, lse[s:e, None].to(cd), out=p).exp_()
        g_n = grad[s:e].to(cd)
        bs = smoothing[s:e].to(cd)
        pm = g_n * (1.0 + 2.0 * z_loss * lse[s:e].to(cd)) if z_loss else g_n
        if extra is not None:
            pm = pm + extra[s:e].to(cd)
        if stats is not None:
            pm = pm / s_c  # (p holds exp(z - m): the softmax's division folded into the weighting)
        torch.addcmul((-g_n * bs / (vocab or v))[:, None], p, pm[:, None], out=p)  # G = pm p - g b / V, one pass
        p.scatter_add_(1, yc, torch.where(valid, -g_n * (1.0 - bs), 0.0)[:, None])
        if softcap is not None:  # the cap's derivative 1 - tanh^2, from the capped logits
            z.div_(softcap)
            p *= z.mul_(z).neg_().add_(1.0)
        if dh is not None:
            torch.mm(p, w, out=dh[s:e])
        if dw is not None:
            dw.addmm_(p.T, h)
        if db is not None:
            db += p.sum(0)
    return stats, dh, dw, db
