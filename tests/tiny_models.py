"""Tiny models from real configs, a word-level tokenizer and small datasets, shared by the tests and by the
subprocess scripts under tests/scripts (which import this file by path).

The heads are sharpened (weights x 8) so that the softmax is far from uniform and label smoothing changes
the loss by much more than any tolerance the tests use."""
from __future__ import annotations

import json
from pathlib import Path

import torch

V = 101
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
# Every family of hf_lsce's table, with the settings that exercise its quirk at tiny scale: small soft-caps (so that
# they matter), logit scales other than 1, and for mixtures of experts few experts, the router's logits on and a
# large auxiliary coefficient (so that a dropped term would show).
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           output_router_logits=True, router_aux_loss_coef=0.5)
FAMILIES = {
    "llama": {}, "mistral": {}, "gemma": {},
    "gemma2": dict(final_logit_softcapping=1.5), "gemma3_text": dict(final_logit_softcapping=2.0),
    "qwen2": {}, "qwen3": {}, "phi3": {}, "smollm3": {}, "olmo2": {}, "olmo3": {}, "glm4": {}, "starcoder2": {},
    "granite": dict(logits_scaling=4.0), "cohere": dict(logit_scale=0.25), "cohere2": dict(logit_scale=0.25),
    "llama4_text": {},
    "mixtral": MOE, "qwen2_moe": MOE, "qwen3_moe": MOE, "olmoe": MOE, "gpt_oss": MOE,
}
SPECIAL = ["<pad>", "<eos>", "<unk>"]
WORDS = [f"w{i}" for i in range(V - len(SPECIAL))]


def tiny_config(model_type: str = "llama", **over):
    """A tiny configuration of ``model_type`` with its family's quirk settings (``FAMILIES``), then ``over``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**COMMON, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": None,
                                               **FAMILIES.get(model_type, {}), **over})


def tiny_model(model_type: str = "llama", seed: int = 0, sharpen: float = 8.0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **over)).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    return model


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*SPECIAL, *WORDS])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def prompt_completion_rows(n: int = 16, seed: int = 0) -> list[dict]:
    """Prompt-completion pairs of unequal completion lengths (1-6 words), so micro-batches hold different
    numbers of loss tokens and a per-micro-batch mean would differ from HF's num_items_in_batch loss."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p = torch.randint(0, 60, (4 + i % 3,), generator=g).tolist()
        c = torch.randint(0, 60, (1 + (i * 5) % 6,), generator=g).tolist()
        rows.append({"prompt": " ".join(WORDS[j] for j in p), "completion": " " + " ".join(WORDS[j] for j in c)})
    return rows


class TokenRows(torch.utils.data.Dataset):
    """Token rows for the plain Trainer, with labels ignored past an unequal length per row."""

    def __init__(self, n: int = 16, t: int = 12, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for i in range(n):
            ids = torch.randint(len(SPECIAL), V, (t,), generator=g)
            lab = ids.clone()
            lab[2 + (i * 7) % (t - 2):] = -100
            self.rows.append({"input_ids": ids, "labels": lab})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def save_checkpoint(path, model_type: str = "llama", seed: int = 0, **over) -> Path:
    """A tiny model and its tokenizer saved as a local checkpoint (what `--model_name_or_path` reads)."""
    path = Path(path)
    tiny_model(model_type, seed=seed, **over).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return path


def save_sft_dataset(path, n: int = 16) -> Path:
    """A local dataset folder (train.jsonl) that `datasets.load_dataset(path)` reads offline."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "train.jsonl", "w") as f:
        for r in prompt_completion_rows(n):
            f.write(json.dumps(r) + "\n")
    return path


def largest_tensor_mode():
    """A TorchDispatchMode recording the largest tensor any op returns while it is active, in elements (``numel``)
    and in bytes (``nbytes``): the evidence that no N x V buffer (logits, or a chunk of rows by the vocabulary) was
    built."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestTensor(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = self.nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
                    self.nbytes = max(self.nbytes, t.numel() * t.element_size())
            return out
    return LargestTensor()

