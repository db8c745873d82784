"""A stock Hugging Face training script (Trainer + HfArgumentParser), as users write them.

It knows nothing of hf_lsce. Run it through `hf-lsce run` and its `--label_smoothing_factor` drives
the fused op (no N x V logits, smoothing exact under gradient accumulation):

    hf-lsce run examples/stock_trainer_script.py --model_name_or_path meta-llama/Llama-3.2-1B \
        --output_dir runs/stock --label_smoothing_factor 0.1 --max_steps 100 --bf16

Without `--model_name_or_path` it builds a tiny Llama from a config and trains on random tokens, so
it runs offline in seconds (the test suite does that):

    hf-lsce run examples/stock_trainer_script.py --output_dir runs/stock --label_smoothing_factor 0.1 \
        --max_steps 5 --use_cpu --report_to none
"""
from dataclasses import dataclass, field

import torch
from transformers import (AutoModelForCausalLM, HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer,
                          TrainingArguments)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=None, metadata={"help": "hub name or path; default: a tiny Llama"})
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
    torch.manual_seed(targs.seed)
    if margs.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(margs.model_name_or_path)
        vocab = model.config.vocab_size
    else:
        config = LlamaConfig(vocab_size=margs.vocab_size, hidden_size=margs.hidden_size, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        model, vocab = LlamaForCausalLM(config), margs.vocab_size
    trainer = Trainer(model=model, args=targs, train_dataset=TokenData(margs.num_examples, margs.seq_len, vocab))
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
