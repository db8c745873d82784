"""A few optimizer steps of the HF Trainer (or TRL's SFTTrainer) under one distributed engine; writes what happened.

    python engine_step.py OUT --engine single ...                        (one process)
    torchrun --nproc_per_node 2 engine_step.py OUT --engine zero3 ...   (2 ranks)

Engines: single (one process), ddp, fsdp2 (the Trainer's FSDP2 auto-wrap; GPUs only), zero1 / zero2 / zero3
(DeepSpeed through the Trainer's ``deepspeed=`` argument). On CPU, gloo; DeepSpeed needs ``DS_ACCELERATOR=cpu``. Precision: fp32, or bf16 through the Trainer's ``bf16=True`` flag.

The batch has sequences with unequal label counts (padding masked), so only an exact ``num_items_in_batch`` across
ranks and micro-batches makes every configuration take the same steps. The model is a randomly initialised Llama
(``--size``), the same on every rank and in every run (seed 0).

OUT/result.json (rank 0): the losses the Trainer logged, how many lm_head calls returned full logits, how many
fused calls ran, tokens/s and peak GPU memory; OUT/state.pt: the full trained weights (fp32, on CPU).
``--bypass`` hides the fused op behind a wrapper that calls the original forward (what another library's patch
installed after ours would do): the run-time proof must then stop the step.
"""
import argparse
import json
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--engine", default="single",
               choices=["single", "ddp", "fsdp2", "zero1", "zero2", "zero3"])
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
p.add_argument("--trainer", default="trainer", choices=["trainer", "sft"])
p.add_argument("--patch", type=int, default=1)
p.add_argument("--smoothing", type=float, default=0.1)
p.add_argument("--per-device", type=int, default=2)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--steps", type=int, default=1)
p.add_argument("--seq", type=int, default=12)
p.add_argument("--size", default="tiny", choices=["tiny", "small", "8b"])
p.add_argument("--tied", type=int, default=1)
p.add_argument("--lr", type=float, default=0.5)
p.add_argument("--checkpointing", type=int, default=0)
p.add_argument("--bypass", action="store_true")
p.add_argument("--optim", default="sgd", help="the Trainer's optim (the matrix: sgd; the 8B rows: adamw_torch_fused)")
p.add_argument("--state", type=int, default=1, help="gather and save the trained weights (the matrix compares them)")
a = p.parse_args()

if a.engine == "fsdp2" and a.device == "cpu":
    # accelerate turns FSDP on only for GPU-type devices: on CPU the Trainer would quietly train with DDP instead
    sys.exit("--engine fsdp2 needs --device cuda: on CPU accelerate silently replaces FSDP with DDP (the CPU tests "
             "shard with fully_shard directly: tests/scripts/fsdp2_step.py).")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

SIZES = {  # (vocab, hidden, intermediate, layers, heads, kv heads)
    "tiny": (61, 32, 64, 2, 4, 2),
    "small": (32000, 512, 1408, 4, 8, 4),
    "8b": (128256, 4096, 14336, 32, 32, 8),  # Llama-3-8B
}
V, D, I, L, H, KV = SIZES[a.size]
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
n_rows = a.per_device * a.accum * world * a.steps


class Data(torch.utils.data.Dataset):
    """Token ids and labels; sequence i carries keep[i] labelled tokens, the rest -100."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, V, (n_rows, a.seq), generator=g)
        self.keep = torch.randint(2, a.seq + 1, (n_rows,), generator=g).tolist()

    def __len__(self):
        return n_rows

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.keep[i]:] = -100
        return {"input_ids": self.ids[i], "labels": labels}


torch.manual_seed(0)
init_dtype = torch.bfloat16 if a.size == "8b" else torch.float32  # 8B: bf16 weights, as users load them
local_rank = int(os.environ.get("LOCAL_RANK", "0"))
if a.device == "cuda":
    torch.cuda.set_device(local_rank)
with torch.device(f"cuda:{local_rank}" if a.device == "cuda" else "cpu"):  # the same seed gives the same weights
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=I, num_hidden_layers=L,
                                         num_attention_heads=H, num_key_value_heads=KV, tie_word_embeddings=bool(a.tied),
                                         max_position_embeddings=max(2048, a.seq)))
if init_dtype != torch.float32:
    model.to(init_dtype)

full_logit_calls = [0]


def count_logits(module, inputs, output):
    if torch.is_tensor(output) and output.dim() >= 2 and output.shape[-1] == V:
        full_logit_calls[0] += 1


model.lm_head.register_forward_hook(count_logits)

if a.patch:
    from hf_lsce import apply_lsce_patch

    apply_lsce_patch(model)
if a.bypass:  # another library's forward installed after the patch, never reaching it (e.g. a second fused loss)
    import functools

    from hf_lsce.patching.forward import original_forward

    orig = original_forward(model)
    model.forward = functools.wraps(orig)(lambda *args, **kw: orig(*args, **kw))

extra = {}
if a.engine == "fsdp2":
    extra = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                                 "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                                 "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
elif a.engine.startswith("zero"):
    stage = int(a.engine[-1])
    extra = dict(deepspeed={
        "zero_optimization": {"stage": stage, **({"stage3_gather_16bit_weights_on_model_save": True}
                                                 if stage == 3 else {})},
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": False},
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True})

common = dict(per_device_train_batch_size=a.per_device, gradient_accumulation_steps=a.accum, max_steps=a.steps,
              learning_rate=a.lr, optim=a.optim, lr_scheduler_type="constant", label_smoothing_factor=a.smoothing,
              weight_decay=0.0, max_grad_norm=0.0, use_cpu=a.device == "cpu", report_to="none",
              ddp_backend="gloo" if world > 1 and a.device == "cpu" else None, bf16=a.precision == "bf16",
              gradient_checkpointing=bool(a.checkpointing), save_strategy="no", logging_steps=1, seed=0,
              average_tokens_across_devices=True, dataloader_drop_last=True, disable_tqdm=True, **extra)
if a.trainer == "sft":
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    words = [f"w{i}" for i in range(min(V, 4000) - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    g = torch.Generator().manual_seed(0)
    prompt_len = max(2, a.seq // 3)
    rows = [{"prompt": " ".join(words[j] for j in torch.randint(0, len(words), (prompt_len,), generator=g).tolist()),
             "completion": " " + " ".join(words[j] for j in torch.randint(0, len(words), (int(n),),
                                                                           generator=g).tolist())}
            for n in torch.randint(1, a.seq - prompt_len, (n_rows,), generator=g)]  # label counts differ
    from hf_lsce.patching.trainer import trl_defaults_to_chunked_loss

    # stock TRL 1.9 to 1.14's default chunked loss cannot smooth: the unpatched reference smooths through its "nll"
    # loss there; a patched run keeps the default
    stock_loss = dict(loss_type="nll") if trl_defaults_to_chunked_loss() and not a.patch else {}
    args = SFTConfig(a.out, completion_only_loss=True, max_length=a.seq, **common, **stock_loss)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
else:
    trainer = Trainer(model=model, args=TrainingArguments(a.out, **common), train_dataset=Data())

from hf_lsce.patching import ENGAGEMENT  # noqa: E402

loss_dtypes = set()  # the dtype of each loss the training step hands to backward
_compute_loss = trainer.compute_loss


def compute_loss(*args, **kwargs):
    out = _compute_loss(*args, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    if torch.is_grad_enabled():
        loss_dtypes.add(str(loss.dtype).replace("torch.", ""))
    return out


trainer.compute_loss = compute_loss

cuda = a.device == "cuda"
step_ends = []


class StepTimer(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if cuda:
            torch.cuda.synchronize()
        step_ends.append(time.perf_counter())


trainer.add_callback(StepTimer())
if cuda:
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
error = None
try:
    trainer.train()
except Exception as e:  # noqa: BLE001 - reported, e.g. the engagement proof firing under --bypass
    error = f"{type(e).__name__}: {e}"
if cuda:
    torch.cuda.synchronize()
elapsed = time.perf_counter() - t0

state = None
if error is None and a.state:
    if a.engine == "fsdp2":  # a collective: every rank gathers the full state
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif a.engine == "zero3":  # a collective too
        import deepspeed

        inner = trainer.model_wrapped.module if hasattr(trainer.model_wrapped, "module") else trainer.model
        with deepspeed.zero.GatheredParameters(list(inner.parameters()), modifier_rank=None):
            state = {k: v.detach().float().cpu().clone() for k, v in inner.state_dict().items()}
    else:
        state = {k: v.detach().float().cpu() for k, v in trainer.model.state_dict().items()}
losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
output_dtypes = {}  # FSDP2 units whose outputs FSDP casts: module name -> dtype
for name, module in trainer.model.named_modules():
    if hasattr(module, "_get_fsdp_state"):
        output_dtypes[name or "<root>"] = str(module._get_fsdp_state()._mp_policy.output_dtype)
# tokens/s over the steps after the first (the first pays for compilation, allocation and NCCL set-up)
timed = step_ends[-1] - step_ends[0] if len(step_ends) > 1 else elapsed
tokens = a.per_device * a.seq * a.accum * world * (len(step_ends) - 1 if len(step_ends) > 1 else a.steps)
step_s = sorted(b - e for e, b in zip(step_ends, step_ends[1:]))  # each step after the first
median_s = step_s[(len(step_s) - 1) // 2] if step_s else None  # the lower median: one real step
result = dict(engine=a.engine, precision=a.precision, trainer=a.trainer, patch=a.patch, world=world,
              losses=losses, loss_dtypes=sorted(loss_dtypes), full_logit_calls=full_logit_calls[0], fused_calls=ENGAGEMENT.fused_calls,
              error=error, seconds=elapsed, tokens_per_s=tokens / timed if timed else None, optim=a.optim,
              timed_steps=len(step_s), tokens_per_s_median=a.per_device * a.seq * a.accum * world / median_s
              if median_s else None,
              tokens_per_gpu=a.per_device * a.seq,
              peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
              model_class=type(trainer.model).__name__, fsdp_output_dtypes=output_dtypes, wrapped_class=type(trainer.model_wrapped).__name__)
all_counts = [result["full_logit_calls"], result["fused_calls"]]
if torch.distributed.is_initialized():
    t = torch.tensor(all_counts, dtype=torch.float64, device="cuda" if cuda else "cpu")
    torch.distributed.all_reduce(t)
    result["full_logit_calls"], result["fused_calls"] = int(t[0]), int(t[1])
if rank == 0:
    os.makedirs(a.out, exist_ok=True)
    if state is not None:
        torch.save({k: v.float() for k, v in state.items()}, os.path.join(a.out, "state.pt"))
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
# Skip interpreter teardown: gloo's threads sometimes abort there after every result is written.
sys.stdout.flush()
os._exit(0)
