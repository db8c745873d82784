"""Chunked pure-torch implementation of the fused op: the CPU fallback.

Same contract as the Triton kernels (``dispatch.forward_stats`` / ``backward.py``): the forward returns per-token
statistics, the backward returns gradients for a per-token upstream gradient. Rows are processed in
chunks so that at most ``chunk_rows x V`` logits exist at a time, never the whole ``N x V`` matrix.

Half-precision inputs are computed in fp32 (the weight is upcast once per call), which is what the
kernels do with their fp32 accumulators.
"""
from __future__ import annotations

import torch

# Target size of one chunk of fp32 logits (elements): 2**24 = 64 MiB.
_CHUNK_ELEMENTS = 1 << 24


def chunk_rows(n: int, v: int, chunk_elements: int | None = None) -> int:
    """Rows per chunk so that one chunk of logits holds about ``chunk_elements`` values (default
    ``_CHUNK_ELEMENTS``, read at call time)."""
    if chunk_elements is None:
        chunk_elements = _CHUNK_ELEMENTS
    return max(1, min(n, chunk_elements // max(v, 1)))


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
    z = h @ w.T
    if bias is not None:
        z = z + bias
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return softcap * t, t


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def torch_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    softcap: float | None,
    chunk_elements: int | None = None,
):
    """Per-token (lse, target logit, sum of logits, argmax, entropy) for 2-D ``hidden`` (N, D).

    ``targets`` (N,) int64 may hold any value outside [0, V) for ignored tokens (their target logit
    is 0). Float outputs are fp32 (fp64 for fp64 inputs).
    """
    n, v = hidden.shape[0], weight.shape[0]
    cd = _compute_dtype(hidden)
    w = weight.to(cd)
    b = bias.to(cd) if bias is not None else None
    lse = torch.empty(n, dtype=cd, device=hidden.device)
    zy = torch.empty_like(lse)
    sz = torch.empty_like(lse)
    ent = torch.empty_like(lse)
    am = torch.empty(n, dtype=torch.int64, device=hidden.device)
    step = chunk_rows(n, v, chunk_elements)
    for s in range(0, n, step):
        e = min(n, s + step)
        z, _ = _logits(hidden[s:e].to(cd), w, b, softcap)
        # everything from the logits shifted by the row maximum: entropy = log s - sum e (z - m) / s with
        # e = exp(z - m), s = sum e. Going through lse = m + log s instead loses digits at large logits
        # (one ulp of lse at |z| ~ 1e3 is 1e-4)
        zmax = z.max(-1, keepdim=True).values
        zs = z - zmax
        ez = torch.exp(zs)
        s_c = ez.sum(-1)
        lse[s:e] = zmax[:, 0] + torch.log(s_c)
        ent[s:e] = torch.log(s_c) - (ez * zs).sum(-1) / s_c
        sz[s:e] = z.sum(-1)
        am[s:e] = z.argmax(-1)
        y = targets[s:e]
        valid = (y >= 0) & (y < v)
        zy[s:e] = torch.where(valid, z.gather(1, y.clamp(0, v - 1)[:, None])[:, 0], 0.0)
    return lse, zy, sz, am, ent


def torch_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad: torch.Tensor,
    smoothing: torch.Tensor,
    softcap: float | None,
    chunk_elements: int | None = None,
    need_dh: bool = True,
    need_dw: bool = True,
    extra: torch.Tensor | None = None,
):
    """Gradients of ``sum_n grad_n * loss_n (+ extra-term)`` with respect to hidden, weight and bias.

    ``grad`` (N,) is the upstream gradient of each token's loss (0 for ignored tokens),
    ``smoothing`` (N,) each token's smoothing factor; ``extra`` (N,) adds ``extra_n * p_nv`` to the gradient with
    respect to the logits (the z-loss term, the gradient of an lse output). Returns fp32 (fp64) gradients;
    ``dh`` / ``dw`` are None when not needed (a frozen LM head computes no dW).
    """
    n, v = hidden.shape[0], weight.shape[0]
    cd = _compute_dtype(hidden)
    w = weight.to(cd)
    b = bias.to(cd) if bias is not None else None
    dh = torch.empty(hidden.shape, dtype=cd, device=hidden.device) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=cd, device=hidden.device) if need_dw else None
    db = torch.zeros(v, dtype=cd, device=hidden.device) if bias is not None else None
    step = chunk_rows(n, v, chunk_elements)
    for s in range(0, n, step):
        e = min(n, s + step)
        h = hidden[s:e].to(cd)
        z, t = _logits(h, w, b, softcap)
        p = torch.exp(z - lse[s:e, None].to(cd))
        g = p.clone() if extra is not None else p
        y = targets[s:e]
        bs = smoothing[s:e].to(cd)
        valid = (y >= 0) & (y < v)
        rows = torch.nonzero(valid)[:, 0]
        g[rows, y[rows]] -= 1.0 - bs[rows]
        g -= (bs / v)[:, None]
        g *= grad[s:e, None].to(cd)
        if extra is not None:
            g += extra[s:e, None].to(cd) * p
        if t is not None:
            g *= 1.0 - t * t
        if need_dh:
            dh[s:e] = g @ w
        if need_dw:
            dw += g.T @ h
        if db is not None:
            db += g.sum(0)
    return dh, dw, db
