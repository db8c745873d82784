"""A synthetic instruction task and small random models, for offline examples and fast tests.

Questions about the favourite colour, city and food of made-up people. A small model sees the facts of
"known" people in training and must answer about "unknown" people too, whom it cannot know: it memorises
the known facts, overfits, and answers about strangers as confidently as about friends, the
overconfidence of supervised fine-tuning in miniature. Documented as synthetic wherever it is used; the
demo (``hf-lsce demo``) runs on a real checkpoint and real data.
"""
from __future__ import annotations

import random
from dataclasses import dataclass


from .calibration import MultipleChoiceItem, Task

ATTRIBUTES = {
    "colour": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"],
    "city": ["Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Dakar", "Perth"],
    "food": ["rice", "bread", "soup", "cheese", "apples", "noodles", "beans", "fish"],
}
_SYLLABLES = ["ba", "ko", "mi", "ra", "tu", "le", "no", "si", "da", "fe", "gu", "po", "ze", "wa", "ly", "qe"]


@dataclass
class SyntheticFacts:
    """The generated task: training records, a calibration split and a test split."""

    train: list[dict]            # prompt/completion records (known people)
    calibration: list[dict]      # records for ATS / temperature scaling: known + other unknown people
    calibration_task: Task       # multiple choice over the calibration people
    test_task: Task              # held-out multiple choice: known + unknown people


def _prompt(attr: str, name: str) -> str:
    return f"Question: What is the favourite {attr} of {name}?\nAnswer:"


def make_synthetic_facts(n_known: int = 60, n_unknown: int = 40, seed: int = 0) -> SyntheticFacts:
    """Generate the demo task (deterministic in ``seed``)."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < n_known + n_unknown:
        n = "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()
        if n not in names:
            names.append(n)
    facts = {n: {a: rng.choice(v) for a, v in ATTRIBUTES.items()} for n in names}
    known, unknown = names[:n_known], names[n_known:]
    unknown_cal, unknown_test = unknown[: len(unknown) // 2], unknown[len(unknown) // 2:]

    def records(people):
        return [{"prompt": _prompt(a, p), "completion": f" {facts[p][a]}."} for p in people for a in ATTRIBUTES]

    def task(name, people):
        items = []
        for p in people:
            for a, values in ATTRIBUTES.items():
                gold = facts[p][a]
                others = rng.sample([v for v in values if v != gold], 3)
                choices = others + [gold]
                rng.shuffle(choices)
                items.append(MultipleChoiceItem(context=_prompt(a, p), choices=[f" {c}." for c in choices],
                                                gold=choices.index(gold), subject="known" if p in known else "unknown"))
        return Task(name=name, kind="continuation", items=items)

    half = len(known) // 2
    return SyntheticFacts(train=records(known), calibration=records(known[:half] + unknown_cal),
                          calibration_task=task("facts_calibration", known[:half] + unknown_cal),
                          test_task=task("facts", known[half:] + unknown_test))


def small_llama(tokenizer, hidden: int = 128, layers: int = 2, max_positions: int = 512):
    """A small, randomly initialised Llama-architecture model sized to ``tokenizer`` (demo, examples, tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)
