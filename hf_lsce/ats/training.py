"""Train an ATS head with the Hugging Face Trainer on instruction data (response tokens only)."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from .modeling_ats import ATSCalibrator

logger = logging.getLogger(__name__)

ALPACA_PROMPT = ("Below is an instruction that describes a task{ctx}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca template (with or without an input block)."""
    if input:
        return ALPACA_PROMPT.format(ctx=", paired with an input that provides further context",
                                    instruction=instruction, input_block=f"### Input:\n{input}\n\n")
    return ALPACA_PROMPT.format(ctx="", instruction=instruction, input_block="")


def load_instruction_records(data, limit: int | None = None) -> list[dict]:
    """``{instruction, input, output}`` records from a JSON/JSONL file, a hub dataset name, a
    ``datasets.Dataset`` or a list of dicts. Prompt/completion records (``prompt``, ``completion``)
    are accepted too."""
    if isinstance(data, list):
        rows = data
    elif isinstance(data, (str, os.PathLike)) and os.path.exists(data):
        with open(data, encoding="utf-8") as f:
            text = f.read()
        rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    elif isinstance(data, str):
        try:
            import datasets

            rows = list(datasets.load_dataset(data, split="train"))
        except Exception as e:
            raise FileNotFoundError(f"{data!r} is neither a local JSON/JSONL file nor a loadable hub dataset ({e})") from e
    else:
        rows = list(data)
    out = []
    for i, r in enumerate(rows[:limit] if limit else rows):
        if "prompt" in r and "completion" in r:
            out.append({"prompt": r["prompt"], "completion": r["completion"]})
        elif "instruction" in r and "output" in r:
            out.append({"prompt": alpaca_prompt(r["instruction"], r.get("input", "") or ""), "completion": r["output"]})
        else:
            raise ValueError(f"record {i} has columns {sorted(r)}; expected instruction/input/output (Alpaca) or "
                             "prompt/completion")
    if not out:
        raise ValueError("no training records: the data is empty (or `limit` is 0)")
    return out


def tokenize_records(records: list[dict], tokenizer, max_length: int = 512) -> list[dict]:
    """input_ids with labels on the completion only (-100 on the prompt); EOS appended."""
    rows = []
    for r in records:
        p = tokenizer(r["prompt"], add_special_tokens=True)["input_ids"]
        c = tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            c = c + [tokenizer.eos_token_id]
        ids = (p + c)[:max_length]
        labels = ([-100] * len(p) + c)[:max_length]
        if any(x != -100 for x in labels):
            rows.append({"input_ids": ids, "labels": labels})
    if not rows:
        raise ValueError(f"every example's response falls beyond max_length={max_length}; raise it")
    return rows


@dataclass
class PadCollator:
    pad_id: int

    def __call__(self, rows):
        L = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(rows), L), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), L), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.as_tensor(r["input_ids"])
            lab[i, :n] = torch.as_tensor(r["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def check_tokenizer(base_model, tokenizer) -> None:
    """Fail clearly when the tokenizer cannot belong to the base model."""
    v = base_model.get_output_embeddings().weight.shape[0]
    n = len(tokenizer)
    if n > v:
        raise ValueError(f"the tokenizer has {n} tokens but the base model's vocabulary is {v}: they do not belong "
                         "together. Pass the tokenizer saved with the base model")


def train_ats(base_model, tokenizer, data, *, output_dir: str, head_type: str = "transformer",
              calibrator: ATSCalibrator | None = None, max_steps: int = -1, num_train_epochs: float = 1.0,
              learning_rate: float = 5e-4, per_device_train_batch_size: int = 4, gradient_accumulation_steps: int = 1,
              max_length: int = 512, limit: int | None = None, eval_data=None, resume_from_checkpoint=None,
              report_to="none", logging_steps: int = 10, save_steps: int = 500, seed: int = 0,
              loss_type: str = "selective", **training_kwargs) -> ATSCalibrator:
    """Fit an ATS head on ``data`` (see :func:`load_instruction_records`) with the HF Trainer and save it.

    ``loss_type="selective"`` is the paper's selective smoothing loss; ``"nll"`` fits plain
    cross-entropy (classic temperature scaling, with ``head_type="scalar"``). Progress, checkpoints
    (every ``save_steps``) and ``resume_from_checkpoint`` are the Trainer's. Returns the calibrator,
    saved (head only) in ``output_dir``.
    """
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    if output_dir is None:
        raise ValueError("`output_dir` is required: the head and checkpoints are saved there")
    check_tokenizer(base_model if not isinstance(base_model, ATSCalibrator) else base_model.base_model_lm, tokenizer)
    cal = calibrator or ATSCalibrator.from_base(base_model, head_type=head_type, loss_type=loss_type)
    train = Dataset.from_list(tokenize_records(load_instruction_records(data, limit), tokenizer, max_length))
    evals = (Dataset.from_list(tokenize_records(load_instruction_records(eval_data), tokenizer, max_length))
             if eval_data is not None else None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    use_cpu = next(cal.base_model_lm.parameters()).device.type == "cpu"
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, num_train_epochs=num_train_epochs,
                             learning_rate=learning_rate, per_device_train_batch_size=per_device_train_batch_size,
                             gradient_accumulation_steps=gradient_accumulation_steps, report_to=report_to,
                             logging_steps=logging_steps, save_steps=save_steps, seed=seed, use_cpu=use_cpu,
                             remove_unused_columns=False, save_only_model=False,
                             eval_strategy="steps" if evals is not None else "no",
                             eval_steps=save_steps if evals is not None else None, **training_kwargs)
    trainer = Trainer(model=cal, args=args, train_dataset=train, eval_dataset=evals, data_collator=PadCollator(pad))
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(output_dir)
    logger.info("ATS head (%s) saved to %s", cal.config.head_type, output_dir)
    return cal.eval()


@torch.no_grad()
def token_calibration(model, tokenizer, data, *, max_length: int = 512, batch_size: int = 4, limit: int | None = None,
                      n_bins: int = 15, progress: bool = False):
    """Next-token calibration on the response tokens of instruction ``data``: top-1 confidence against
    correctness, as ``calibration_metrics`` reports it (ECE, RMS, MCE, accuracy, mean confidence...).

    ``model`` is a causal LM or an :class:`ATSCalibrator` (whose logits are calibrated), so one call
    measures a base model before and after ATS on the same tokens.
    """
    from tqdm.auto import tqdm

    from ..calibration import calibration_metrics
    from ..calibration.scoring import _device_of

    rows = tokenize_records(load_instruction_records(data, limit), tokenizer, max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    collate = PadCollator(pad)
    dev = _device_of(model)
    conf, corr = [], []
    was_training = model.training
    model.eval()
    for i in tqdm(range(0, len(rows), batch_size), desc="token calibration", disable=not progress):
        batch = {k: v.to(dev) for k, v in collate(rows[i:i + batch_size]).items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits[:, :-1]
        target = labels[:, 1:]
        keep = target != -100
        probs = torch.softmax(logits[keep].float(), -1)  # only the response positions
        c, pred = probs.max(-1)
        conf.append(c.cpu())
        corr.append((pred == target[keep]).double().cpu())
    model.train(was_training)
    return calibration_metrics(confidences=torch.cat(conf), correct=torch.cat(corr), n_bins=n_bins)
