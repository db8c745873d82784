"""The op over a vocabulary shard (a tensor-parallel LM head), exact across ranks.

Each rank holds rows ``[start, start + V_r)`` of the head and computes on its shard the statistics of the
single-device op; three all-reduces make them global (``lse = M + log sum_r exp(lse_r - M)``, the target logit and the
sum of logits by sum), so every rank holds the full per-token loss. Backward on each shard: G with the global lse and
the whole vocabulary's ``V`` (``paths.dense_backward``'s ``vocab``); ``dW`` is the shard's, ``dh`` is all-reduced, as a
column-parallel linear's input gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .matmul import times_gamma
from .paths import dense_backward, statistics


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
    def forward(ctx, hidden, weight, bias, targets, smoothing, opts, shard):
        group, v_r, v = shard.group, weight.shape[0], shard.vocab_size
        valid = targets >= 0
        # local target ids; a valid token whose target lives on another rank gets v_r (matches no column)
        local = targets - shard.start
        here = valid & (local >= 0) & (local < v_r)
        local_t = torch.where(here, local, torch.where(valid, torch.full_like(local, v_r), local)).contiguous()
        lse_r, zy, sz = statistics(hidden, weight, bias, local_t, opts)[:3]
        m = lse_r.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        s = torch.exp(lse_r - m)
        stacked = torch.stack([s, zy, sz])  # one sum all-reduce for the three
        dist.all_reduce(stacked, group=group)
        lse = m + torch.log(stacked[0])
        zy, sz = stacked[1], stacked[2]
        b = smoothing.to(lse.dtype)
        per = lse - (1.0 - b) * zy - b * sz / v
        if opts.z_loss:
            per = per + opts.z_loss * lse * lse
        loss = torch.where(valid, per, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, local_t, lse, smoothing)
        ctx.opts, ctx.shard = opts, shard
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            raise RuntimeError("linear_cross_entropy does not support double backward (create_graph=True).")
        hidden, weight, bias, local_t, lse, smoothing = ctx.saved_tensors
        grad = torch.where(local_t >= 0, grad_loss.float(), torch.zeros_like(grad_loss, dtype=torch.float32))
        dh, dw, db, gamma = dense_backward(hidden, weight, bias, local_t, lse.float().contiguous(), grad.contiguous(),
                                           smoothing.float().contiguous(), ctx.opts, vocab=ctx.shard.vocab_size)
        times_gamma((dh, dw, db), gamma)  # (fp16: the true gradients before the all-reduce)
        dist.all_reduce(dh, group=ctx.shard.group)  # every shard's part of dL/dh
        return (dh.to(hidden.dtype), dw.to(weight.dtype), db.to(bias.dtype) if db is not None else None,
                None, None, None, None)


def vocab_parallel_token_losses(hidden, weight, bias, targets, smoothing, opts, shard: VocabShard):
    """Per-token smoothed losses (N,) of 2-D inputs over a vocabulary shard (see the module docstring)."""
    return _VocabParallelLinearCrossEntropy.apply(hidden, weight, bias, targets, smoothing, opts, shard)
