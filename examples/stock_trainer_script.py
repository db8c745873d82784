"""A stock Hugging Face training script (Trainer + HfArgumentParser), as users write them.

It knows nothing of hf_lsce: `hf-lsce run` must make its --label_smoothing_factor drive the fused op.
It builds a tiny Llama from a config (no hub access in tests) and trains on synthetic token data.
"""
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


@dataclass
class ModelArguments:
    vocab_size: int = field(default=97)
    hidden_size: int = field(default=32)
    num_examples: int = field(default=32)
    seq_len: int = field(default=12)


class TokenData(torch.utils.data.Dataset):
    def __init__(self, n, seq_len, vocab):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i].clone()}


def main():
    margs, targs = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    config = LlamaConfig(vocab_size=margs.vocab_size, hidden_size=margs.hidden_size, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(targs.seed)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=targs, train_dataset=TokenData(margs.num_examples, margs.seq_len, margs.vocab_size))
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
