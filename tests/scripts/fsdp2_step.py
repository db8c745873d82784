"""Run by torch.distributed.run with 2 gloo processes: FSDP2 (fully_shard) on a patched, tied-embedding Llama.

Each rank takes half of a batch whose label counts differ, scales its loss by the world size (the Trainer's
average_tokens_across_devices convention), and backpropagates through FSDP2 (lm_head weight sharded, gathered
for the forward, its gradient reduce-scattered). The full gradients must equal one unsharded, unpatched model's
on the whole batch with the materialised smoothed loss. Two layouts: tied embeddings with the head in the root
unit, and an untied head wrapped as its own FSDP unit. Rank 0 writes the largest relative differences.
"""
import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from hf_lsce import apply_lsce_patch

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
V, B = 61, 0.1
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, V, (4, 10), generator=g)
labels = ids.clone()
for i, keep in enumerate([3, 10, 6, 2]):
    labels[i, keep:] = -100
n_items = int((labels[:, 1:] != -100).sum())
mine = slice(2 * rank, 2 * rank + 2)


def run(tied, separate_head, bf16=False):
    """One step on the shared batch; the largest relative gradient difference to unsharded HF, and the losses.

    ``bf16``: accelerate's FSDP2 layout and mixed precision for ``bf16=True`` (each decoder layer, then the final
    norm and the head as one unit with ``reshard_after_forward=False``, then the root; parameters, reductions and
    outputs in bf16: accelerate casts every unit's outputs). The reference then runs the same bf16 weights."""
    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=tied)).train()
    model = apply_lsce_patch(copy.deepcopy(ref), label_smoothing=B)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                              output_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    if bf16:  # accelerate's tail unit: the final norm and the head, with the input embedding when tied
        tail = [model.model.norm, model.model.embed_tokens, model.lm_head] if tied else [model.model.norm,
                                                                                          model.lm_head]
        fully_shard(tail, mp_policy=mp, reshard_after_forward=False)
    elif separate_head:  # what the Trainer's FSDP2 auto-wrap did on our 2-GPU run: the head its own unit
        fully_shard(model.lm_head)
    fully_shard(model, mp_policy=mp)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after sharding
    out = model(input_ids=ids[mine], labels=labels[mine], num_items_in_batch=n_items)
    loss = out.loss * world
    loss.backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             for n, p in model.named_parameters()}
    if bf16:
        ref.to(torch.bfloat16)
    logits = ref(input_ids=ids).logits[:, :-1].float()
    ref_loss = F.cross_entropy(logits.reshape(-1, V), labels[:, 1:].reshape(-1), label_smoothing=B,
                               reduction="sum") / n_items
    ref_loss.backward()
    diff = max(float((grads[n].float() - p.grad.float()).norm() / p.grad.float().norm())
               for n, p in ref.named_parameters())
    total = loss.detach() / world
    dist.all_reduce(total)
    return dict(max_rel_grad_diff=diff, loss=float(total), ref_loss=float(ref_loss), cls=type(model).__name__,
                head_cls=type(model.lm_head).__name__, loss_dtype=str(out.loss.dtype))


out = {"tied_root_head": run(tied=True, separate_head=False), "separate_head": run(tied=False, separate_head=True),
       "accelerate_bf16_tied": run(tied=True, separate_head=False, bf16=True),
       "accelerate_bf16_untied": run(tied=False, separate_head=False, bf16=True)}
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
# Skip interpreter teardown: gloo's threads sometimes abort there ("terminate called without an active
# exception") after every result is written, which would fail the run for nothing.
sys.stdout.flush()
os._exit(0)
