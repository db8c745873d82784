"""Train an ATS head with the Hugging Face Trainer on instruction data (response tokens only)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..data import ALPACA_PROMPT, alpaca_prompt, load_instruction_records  # noqa: F401 (one loader, re-exported)
from .modeling_ats import ATSCalibrator

logger = logging.getLogger(__name__)

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


def check_training_args(*, max_steps=-1, num_train_epochs=1.0, learning_rate=5e-4, per_device_train_batch_size=4,
                        gradient_accumulation_steps=1, max_length=512, logging_steps=10, save_steps=500,
                        limit=None) -> None:
    """Reject settings that would train nothing or fail deep inside the Trainer, before loading any data."""
    import math

    def whole(name, v, lo):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"`{name}` must be an integer >= {lo}; got {v!r}")

    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or (max_steps < 1 and max_steps != -1):
        raise ValueError(f"`max_steps` must be a positive integer, or -1 to train for `num_train_epochs`; got {max_steps!r}")
    if max_steps == -1 and (isinstance(num_train_epochs, bool) or not isinstance(num_train_epochs, (int, float))
                            or not math.isfinite(num_train_epochs) or num_train_epochs <= 0):
        raise ValueError(f"`num_train_epochs` must be > 0 (or set max_steps); got {num_train_epochs!r}: nothing would "
                         "be trained")
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not (
            math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"`learning_rate` must be a finite number > 0; got {learning_rate!r}")
    whole("per_device_train_batch_size", per_device_train_batch_size, 1)
    whole("gradient_accumulation_steps", gradient_accumulation_steps, 1)
    whole("max_length", max_length, 2)
    whole("logging_steps", logging_steps, 1)
    whole("save_steps", save_steps, 1)
    if limit is not None:
        whole("limit", limit, 1)


def train_ats(base_model, tokenizer, data, *, output_dir: str, head_type: str = "transformer",
              calibrator: ATSCalibrator | None = None, max_steps: int = -1, num_train_epochs: float = 1.0,
              learning_rate: float = 5e-4, per_device_train_batch_size: int = 4, gradient_accumulation_steps: int = 1,
              max_length: int = 512, limit: int | None = None, eval_data=None, resume_from_checkpoint=None,
              report_to="none", logging_steps: int = 10, save_steps: int = 500, seed: int = 0,
              loss_type: str = "selective", overwrite: bool = False, **training_kwargs) -> ATSCalibrator:
    """Fit an ATS head on ``data`` (see :func:`load_instruction_records`) with the HF Trainer and save it.

    ``loss_type="selective"`` is the paper's selective smoothing loss; ``"nll"`` fits plain
    cross-entropy (classic temperature scaling, with ``head_type="scalar"``). Progress, checkpoints
    (every ``save_steps``) and ``resume_from_checkpoint`` are the Trainer's. Returns the calibrator,
    saved (head only) in ``output_dir``. ``output_dir`` must be new or empty, or hold an earlier run of this
    function (``overwrite=True`` to replace it, ``resume_from_checkpoint`` to continue it): it is never
    written over a folder holding other files (see :mod:`hf_lsce.outputs`).
    """
    from ..outputs import output_folder
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    if output_dir is None:
        raise ValueError("`output_dir` is required: the head and checkpoints are saved there")
    check_training_args(max_steps=max_steps, num_train_epochs=num_train_epochs, learning_rate=learning_rate,
                        per_device_train_batch_size=per_device_train_batch_size,
                        gradient_accumulation_steps=gradient_accumulation_steps, max_length=max_length,
                        logging_steps=logging_steps, save_steps=save_steps, limit=limit)
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
    resume = resume_from_checkpoint is not None and resume_from_checkpoint is not False

    def has_checkpoint(p):
        return any(p.glob("checkpoint-*"))

    with output_folder(output_dir, command="train-ats", overwrite=overwrite, resume=resume,
                       resumable=has_checkpoint) as out:
        if resume_from_checkpoint is True and not has_checkpoint(out):
            raise FileNotFoundError(f"{output_dir} holds no Trainer checkpoint (checkpoint-*) to resume from; "
                                    "start again with overwrite=True (--overwrite)")
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
