"""The fused op over a vocabulary shard (tensor-parallel LM head), exact across ranks.

Each rank holds rows ``[start, start + V_r)`` of the LM head. Per token it computes, on its shard
only, the same statistics as the single-device op (log-sum-exp, target logit, sum of logits) with
the same backends (Triton kernels or the chunked torch path), and three all-reduces make them
global: ``lse = M + log sum_r exp(lse_r - M)`` with ``M = max_r lse_r`` (max, then sum), and the
target logit and the sum of logits by sum (a token's target lives on exactly one rank; the others
contribute 0). Every rank then holds the full per-token loss

    (1 - b)(lse - z_y) + b(lse - sum_v z_v / V).

Backward, on each rank's shard: ``dz = g (softmax(z) - (1 - b) onehot(y) - b / V)`` (times
``1 - tanh^2`` under soft-cap), with the global lse. The backends subtract ``b' / V_r`` for a
smoothing ``b'`` they are given, so they are called with ``b' = b V_r / V`` (the uniform term comes
out exactly ``b / V``) and the one-hot coefficient is then mended on the target column alone:
``dz[n, y_n] += g_n (b_n - b'_n) (1 - t_ny^2)``, a sparse, exact correction. ``dW`` is the shard's own;
``dh`` is a partial sum over the shard and is all-reduced, as a column-parallel linear's input
gradient would be.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .dispatch import dense_backward, forward_stats
from .matmul import times_gamma


@dataclass(frozen=True)
class VocabShard:
    group: object
    start: int
    vocab_size: int  # the full vocabulary


def vocab_shard(weight: torch.Tensor, group, return_stats: bool) -> VocabShard:
    """Where this rank's shard sits in the vocabulary (one all-gather of the shard sizes)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group was given but torch.distributed is not initialised; call "
                         "torch.distributed.init_process_group first (or pass process_group=None).")
    if return_stats:
        raise ValueError("return_stats=True is not available with process_group (the per-token stats would need "
                         "more all-reduces); compute them on an unsharded head.")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("weight must be this rank's (V_r, D) shard of the LM head.")
    sizes = [torch.zeros(1, dtype=torch.int64, device=weight.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device), group=group)
    sizes = [int(s) for s in sizes]
    rank = dist.get_rank(group)
    return VocabShard(group, sum(sizes[:rank]), sum(sizes))


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, smoothing, softcap, backend, shard, z_loss=0.0):
        group, v_r, v = shard.group, weight.shape[0], shard.vocab_size
        valid = targets >= 0
        # local target ids; a valid token whose target lives on another rank gets v_r (matches no column)
        local = targets - shard.start
        here = valid & (local >= 0) & (local < v_r)
        local_t = torch.where(here, local, torch.where(valid, torch.full_like(local, v_r), local)).contiguous()
        lse_r, zy, sz, _, _ = forward_stats(hidden, weight, bias, local_t, softcap, backend, stats=False)
        m = lse_r.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = torch.exp(lse_r - m)
        stacked = torch.stack([s, zy, sz])  # one sum all-reduce for the three
        dist.all_reduce(stacked, group=group)
        lse = m + torch.log(stacked[0])
        zy, sz = stacked[1], stacked[2]
        b = smoothing.to(lse.dtype)
        per = lse - (1.0 - b) * zy - b * sz / v
        if z_loss:
            per = per + z_loss * lse * lse
        loss = torch.where(valid, per, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, local_t, here, lse, zy, smoothing)
        ctx.softcap, ctx.backend, ctx.shard, ctx.z_loss = softcap, backend, shard, z_loss
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            raise RuntimeError("linear_cross_entropy does not support double backward (create_graph=True).")
        hidden, weight, bias, local_t, here, lse, zy, smoothing = ctx.saved_tensors
        v_r, v = weight.shape[0], ctx.shard.vocab_size
        grad = torch.where(local_t >= 0, grad_loss.float(), torch.zeros_like(grad_loss, dtype=torch.float32))
        b = smoothing.float()
        b_local = b * (v_r / v)  # the backend's uniform term b'/V_r is then exactly b/V
        extra = (grad * (2.0 * ctx.z_loss) * lse.float()).contiguous() if ctx.z_loss else None
        dh, dw, db, gamma = dense_backward(hidden, weight, bias, local_t, lse, grad.contiguous(), b_local.contiguous(),
                                           ctx.softcap, ctx.backend, extra=extra)
        times_gamma((dh, dw, db), gamma)  # (fp16: the true gradients before the mend and the all-reduce)
        rows = torch.nonzero(here)[:, 0]
        if rows.numel():  # the one-hot coefficient: (1 - b) where the backend used (1 - b')
            c = grad[rows] * (b[rows] - b_local[rows])
            if ctx.softcap is not None:
                t = zy[rows].float() / ctx.softcap
                c = c * (1.0 - t * t)
            cols = local_t[rows]
            # The mend in fp32 and cast once to each buffer's dtype (the backends return dh / dW in the inputs'
            # dtype, fp32 for fp16 inputs (matmul.kept_dtype), and db in fp32: with a half-precision bias they differ).
            dh.index_add_(0, rows, (c[:, None] * weight[cols].float()).to(dh.dtype))
            dw.index_add_(0, cols, (c[:, None] * hidden[rows].float()).to(dw.dtype))
            if db is not None:
                db.index_add_(0, cols, c.to(db.dtype))
        dist.all_reduce(dh, group=ctx.shard.group)  # every shard's part of dL/dh
        return (dh.to(hidden.dtype), dw.to(weight.dtype), db.to(bias.dtype) if db is not None else None,
                None, None, None, None, None, None)


def vocab_parallel_token_losses(hidden, weight, bias, targets, smoothing, softcap, backend, shard: VocabShard,
                                z_loss: float = 0.0):
    """Per-token smoothed losses (N,) of 2-D inputs over a vocabulary shard (see the module docstring)."""
    return _VocabParallelLinearCrossEntropy.apply(hidden, weight, bias, targets, smoothing, softcap, backend, shard,
                                                  z_loss)
