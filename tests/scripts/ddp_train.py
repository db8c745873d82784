"""One optimizer step of the HF Trainer on a fixed global batch; saves the updated lm_head and embeddings.

    python ddp_train.py OUT PATCH(0|1) PER_DEVICE_BATCH GRAD_ACCUM [MODE]    (one process)
    torchrun --nproc_per_node 2 ddp_train.py OUT 1 2 2 [MODE]                (DDP)

MODE: cpu (default; DDP over gloo), cuda (DDP over NCCL), fsdp2 (FSDP2 full_shard over NCCL).

Eight sequences whose label counts differ (padding masked with -100), so a per-micro-batch mean
would weight tokens differently than the single-process run: only a correct num_items_in_batch
across ranks and micro-batches makes every configuration take the same step.
"""
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

out, patch, per_device, accum = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "cpu"
distributed = "WORLD_SIZE" in os.environ
extra = {}
if mode == "fsdp2":
    extra = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                                 "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                 "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
V, T = 61, 12


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, V, (8, T), generator=g)
        self.keep = [3, 12, 5, 9, 12, 2, 7, 11]  # labelled tokens per sequence

    def __len__(self):
        return 8

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.keep[i]:] = -100
        return {"input_ids": self.ids[i], "labels": labels}


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
if patch:
    from hf_lsce import apply_lsce_patch

    apply_lsce_patch(model)
args = TrainingArguments(out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accum, max_steps=1,
                         learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", label_smoothing_factor=0.1,
                         weight_decay=0.0, max_grad_norm=0.0, use_cpu=mode == "cpu", report_to="none",
                         ddp_backend="gloo" if distributed and mode == "cpu" else None, **extra,
                         save_strategy="no", logging_steps=1, seed=0, average_tokens_across_devices=True)
trainer = Trainer(model=model, args=args, train_dataset=Data())
trainer.train()
if mode == "fsdp2":  # a collective: every rank gathers the full (unsharded) state
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
else:
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
if trainer.is_world_process_zero():
    torch.save(state, f"{out}/state.pt")
    torch.save(trainer.state.log_history, f"{out}/log.pt")
if torch.distributed.is_initialized():  # an orderly gloo shutdown (an implicit one can abort at exit)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
# Skip interpreter teardown: gloo's threads sometimes abort there ("terminate called without an active
# exception") after every result is written, which would fail the run for nothing.
sys.stdout.flush()
os._exit(0)
