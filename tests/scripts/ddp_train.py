"""One optimizer step of the HF Trainer (or TRL's SFTTrainer) on a fixed global batch; saves the updated weights.

    python ddp_train.py OUT PATCH(0|1) PER_DEVICE_BATCH GRAD_ACCUM [MODE [TRAINER]]    (one process)
    torchrun --nproc_per_node 2 ddp_train.py OUT 1 2 2 [MODE [TRAINER]]                (DDP)

MODE: cpu (default; DDP over gloo), cuda (DDP over NCCL), fsdp2 (FSDP2 full_shard over NCCL).
TRAINER: trainer (default; transformers' Trainer on token ids and labels) or sft (TRL's SFTTrainer on
prompt-completion text with completion-only loss; completions of different lengths).

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
kind = sys.argv[6] if len(sys.argv) > 6 else "trainer"
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
common = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=accum, max_steps=1,
              learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", label_smoothing_factor=0.1,
              weight_decay=0.0, max_grad_norm=0.0, use_cpu=mode == "cpu", report_to="none",
              ddp_backend="gloo" if distributed and mode == "cpu" else None, **extra,
              save_strategy="no", logging_steps=1, seed=0, average_tokens_across_devices=True)
if kind == "sft":
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    words = [f"w{i}" for i in range(V - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt": " ".join(words[j] for j in torch.randint(0, 50, (4,), generator=g).tolist()),
             "completion": " " + " ".join(words[j] for j in torch.randint(0, 50, (n,), generator=g).tolist())}
            for n in (1, 6, 3, 2, 7, 1, 4, 5)]  # label counts differ across sequences
    args = SFTConfig(out, completion_only_loss=True, bf16=False, **common)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
else:
    trainer = Trainer(model=model, args=TrainingArguments(out, **common), train_dataset=Data())
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
