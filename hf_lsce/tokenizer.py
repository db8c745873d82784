"""Train a small byte-level BPE tokenizer from text: for tests, the demo and offline examples.

No machine here reaches the hub, so runs that need a tokenizer and have no pretrained one train
this one in a second or two. Byte-level, so every string round-trips and nothing is unknown.
"""
from __future__ import annotations

from typing import Iterable

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 2048, *, min_frequency: int = 2,
                        model_max_length: int = 2048):
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) trained on ``texts``; adds BOS to every sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"`vocab_size` must be at least 300 (256 bytes + specials + merges); got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id(SPECIAL_TOKENS["bos_token"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **SPECIAL_TOKENS)
