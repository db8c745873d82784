"""``hf-lsce demo``: the whole story on a small model, on CPU in minutes or on a GPU.

1. A synthetic instruction task, generated here (documented as synthetic): questions about the
   favourite colour, city and food of made-up people. The model sees the facts of "known" people
   in training and must answer about "unknown" people too, whom it cannot know: a small model
   memorises the known facts, overfits, and answers about strangers as confidently as about friends.
   That is the overconfidence of supervised fine-tuning, in miniature.
2. A small Llama-architecture model (from a config) and a byte-level BPE tokenizer trained on the
   task, fine-tuned with TRL's ``SFTTrainer`` through ``apply_lsce_patch`` twice, same seed:
   label smoothing 0 and 0.1. ``CalibrationCallback`` logs calibration on the held-out
   multiple-choice split during training.
3. An ``ATSCalibrator`` and scalar temperature scaling fitted on the unsmoothed model (calibration
   split), then one table: accuracy, ECE, RMS, NLL on the held-out test split for: no smoothing,
   smoothing 0.1, no smoothing + ATS, no smoothing + temperature scaling; reliability diagrams and a
   JSON report. The numbers are what they are: the demo reports them, whichever way they go.

``--model`` (a hub name or local path), ``--dataset`` (Alpaca-style records) and ``--eval-tasks`` /
``--data-dir`` (e.g. MMLU files) swap in real parts.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass

import torch

from .calibration import MultipleChoiceItem, Task, reliability_diagram, score_task

logger = logging.getLogger(__name__)

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


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def small_llama(tokenizer, hidden: int = 128, layers: int = 2, max_positions: int = 512):
    """A small, randomly initialised Llama-architecture model sized to ``tokenizer`` (demo, examples, tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _sft(model_factory, tokenizer, train, eval_records, eval_task, *, label_smoothing, steps, lr, batch_size,
         output_dir, seed, eval_steps):
    from datasets import Dataset
    from transformers import set_seed
    from trl import SFTConfig, SFTTrainer

    from . import apply_lsce_patch
    from .calibration import CalibrationCallback

    set_seed(seed)
    model = apply_lsce_patch(model_factory())
    dev = _device()
    args = SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size,
                     per_device_eval_batch_size=batch_size, learning_rate=lr, lr_scheduler_type="constant",
                     label_smoothing_factor=label_smoothing, logging_steps=max(1, steps // 10),
                     eval_strategy="steps", eval_steps=eval_steps, save_strategy="no", report_to="none", seed=seed,
                     use_cpu=dev.type == "cpu", bf16=dev.type == "cuda", max_length=128,
                     disable_tqdm=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(train),
                         eval_dataset=Dataset.from_list(eval_records), processing_class=tokenizer)
    cb = CalibrationCallback([eval_task], n_bins=10, batch_size=32, tokenizer=tokenizer).attach(trainer)
    trainer.train()
    return trainer.model.eval(), cb.history


def run_demo(output_dir: str = "hf_lsce_demo", *, label_smoothing: float = 0.1, model: str | None = None,
             dataset: str | None = None, eval_tasks: str | None = None, data_dir: str | None = None,
             steps: int = 600, ats_steps: int = 300, hidden: int = 128, layers: int = 2, lr: float = 3e-3,
             batch_size: int = 16, seed: int = 0, tiny: bool = False) -> dict:
    """Run the demo; returns the report (also written to ``output_dir/report.json``)."""
    from .ats import ATSCalibrator
    from .ats.training import load_instruction_records, train_ats
    from .calibration.tasks import resolve_tasks
    from .tokenizer import train_bpe_tokenizer

    if not 0 < label_smoothing <= 1:
        raise ValueError(f"`label_smoothing` must lie in (0, 1]; got {label_smoothing} (the demo compares it to 0)")
    if tiny:
        steps, ats_steps, hidden = min(steps, 60), min(ats_steps, 40), min(hidden, 64)
    os.makedirs(output_dir, exist_ok=True)
    report_path = os.path.join(output_dir, "report.json")
    facts = make_synthetic_facts(seed=seed)
    if dataset is None:
        train, calib_records = facts.train, facts.calibration
    else:  # the last tenth of the user's records calibrates ATS / temperature scaling
        records = load_instruction_records(dataset)
        cut = max(1, len(records) // 10)
        if len(records) < 2:
            raise ValueError(f"--dataset {dataset} needs at least 2 records (training and calibration)")
        train, calib_records = records[:-cut], records[-cut:]
    test_tasks = [facts.test_task]
    if eval_tasks:
        test_tasks = resolve_tasks(eval_tasks, data_dir, limit=200)

    if model is None:
        texts = [r["prompt"] + r["completion"] for r in train + calib_records]
        texts += [it.context + c for t in test_tasks + [facts.calibration_task] for it in t.items for c in it.choices]
        tokenizer = train_bpe_tokenizer(texts, vocab_size=1024, model_max_length=512)
        factory = lambda: small_llama(tokenizer, hidden, layers)  # noqa: E731
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        factory = lambda: AutoModelForCausalLM.from_pretrained(model, dtype="auto")  # noqa: E731
    eval_steps = max(1, steps // 4)

    rows, history, models = {}, {}, {}
    for b in (0.0, label_smoothing):
        key = f"smoothing {b:g}"
        logger.info("fine-tuning with label smoothing %g", b)
        m, hist = _sft(factory, tokenizer, train, calib_records[:64], test_tasks[0], label_smoothing=b, steps=steps,
                       lr=lr, batch_size=batch_size, output_dir=os.path.join(output_dir, f"sft_b{b:g}"), seed=seed,
                       eval_steps=eval_steps)
        models[key], history[key] = m, hist

    base = models["smoothing 0"]
    for p in base.parameters():
        p.requires_grad_(False)
    cals = {}
    for name, head, loss, alr in (("smoothing 0 + ATS", "transformer", "selective", 2e-3),
                                  ("smoothing 0 + temperature scaling", "scalar", "nll", 5e-2)):
        logger.info("fitting %s", name)
        cal = ATSCalibrator.from_base(base, head_type=head, loss_type=loss)
        cals[name] = train_ats(base, tokenizer, calib_records, calibrator=cal, max_steps=ats_steps,
                               learning_rate=alr, per_device_train_batch_size=batch_size, max_length=128,
                               output_dir=os.path.join(output_dir, "ats" if head == "transformer" else "ts"),
                               save_steps=max(ats_steps, 1), logging_steps=max(1, ats_steps // 5), seed=seed)
    scorers = {**models, **cals}
    for task in test_tasks:
        rows[task.name] = {}
        for name, m in scorers.items():
            s = score_task(m, tokenizer, task, batch_size=32, n_bins=10, progress=False)
            png = os.path.join(output_dir, f"reliability_{task.name}_{name.replace(' ', '_').replace('+', 'plus')}.png")
            reliability_diagram(s.metrics, png, title=f"{task.name}: {name}")
            rows[task.name][name] = {**s.summary(), "diagram": png}
    report = {"output_dir": output_dir, "device": str(_device()), "steps": steps, "ats_steps": ats_steps,
              "label_smoothing": label_smoothing, "model": model or f"Llama config, hidden {hidden}, {layers} layers",
              "dataset": dataset or "synthetic facts (hf_lsce.demo.make_synthetic_facts)",
              "results": rows, "calibration_during_training": history}
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    return report


def format_report(report: dict) -> str:
    lines = []
    for task, rows in report["results"].items():
        lines.append(f"held-out {task} ({next(iter(rows.values()))['n']:.0f} questions):")
        lines.append(f"  {'method':<36}{'acc':>8}{'ECE':>8}{'RMS':>8}{'NLL':>8}")
        for name, r in rows.items():
            lines.append(f"  {name:<36}{r['acc']:>8.3f}{r['ece']:>8.3f}{r['rms']:>8.3f}{r['nll']:>8.3f}")
    lines.append(f"report: {os.path.join(report['output_dir'], 'report.json')}")
    lines.append(f"reliability diagrams: {report['output_dir']}/reliability_*.png")
    return "\n".join(lines)
