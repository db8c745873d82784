"""The short fine-tunings that ``hf-lsce demo``, ``hf-lsce sweep`` and ``hf-lsce diagnose --probe`` share: the budgets
(steps, batch, items and shots per task, by machine), the split of the instruction data into SFT and held-out records,
and one SFT run through ``apply_lsce_patch`` and TRL's ``SFTTrainer`` from a checkpoint's weights."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DATA = "trivia_qa,nq_open"


@dataclass(frozen=True)
class Budget:
    """How much the demo does: SFT steps and batch, ATS steps, items and shots per task."""

    name: str
    sft_steps: int
    batch_size: int
    max_length: int
    lr: float
    ats_steps: int
    limits: dict = field(default_factory=dict)
    shots: dict = field(default_factory=dict)
    records: int | None = None  # instruction records used (None: all)
    calibration_records: int = 256
    bf16: bool = False


BUDGETS = {
    "tiny": Budget("tiny", sft_steps=2, batch_size=4, max_length=96, lr=5e-5, ats_steps=2,
                   limits={"mmlu": 8, "arc_easy": 8, "sciq": 8, "piqa": 8}, shots={"mmlu": 0}, records=120,
                   calibration_records=16),
    "cpu": Budget("cpu", sft_steps=8, batch_size=8, max_length=128, lr=5e-5, ats_steps=10,
                  limits={"mmlu": 40, "arc_easy": 60, "sciq": 50, "piqa": 60}, shots={"mmlu": 0}, records=2000,
                  calibration_records=128),
    "gpu": Budget("gpu", sft_steps=300, batch_size=32, max_length=256, lr=2e-5, ats_steps=300,
                  limits={"mmlu": 1000, "arc_easy": None, "sciq": None, "piqa": 1000}, shots={"mmlu": 5}, records=None,
                  calibration_records=1024, bf16=True),
}


def token_records(records: list, plan: Budget) -> list:
    """The held-out instruction records whose next tokens the diagnosis, the demo and the sweep measure: the last
    64 on the GPU budget, 16 elsewhere (a forward pass each)."""
    return records[-min(len(records), 64 if plan.name == "gpu" else 16):]


def device() -> torch.device:
    """CUDA where there is one, else the CPU: where the short fine-tunings and their scoring run."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def choose_budget(budget: str = "auto", *, steps: int | None = None, ats_steps: int | None = None) -> Budget:
    """The named budget (``"auto"``: gpu with CUDA, else cpu), with ``steps`` / ``ats_steps`` over its own."""
    if budget == "auto":
        budget = "gpu" if torch.cuda.is_available() else "cpu"
    if budget not in BUDGETS:
        raise ValueError(f"budget must be 'auto' or one of {sorted(BUDGETS)}, got {budget!r}")
    plan = BUDGETS[budget]
    for name, v in (("steps", steps), ("ats_steps", ats_steps)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive integer; got {v!r}")
    if steps is not None or ats_steps is not None:
        plan = Budget(**{**asdict(plan), "sft_steps": steps or plan.sft_steps, "ats_steps": ats_steps or plan.ats_steps})
    return plan


def prepare(model: str, plan: Budget, eval_tasks: str, limit, dataset: str | None, data_dir: str | None,
            command: str = "demo"):
    """(checkpoint path, tokenizer with a pad token, shots per task, SFT records, held-out records, tasks): what the
    demo and the sweep start from."""
    from .calibration.tasks import resolve_tasks
    from .checkpoints import checked_model_path, load_tokenizer

    names, limits, shots = task_plan(eval_tasks, plan, limit)
    path = checked_model_path(model)
    tokenizer = load_tokenizer(path)
    train, held_out = instruction_split(dataset, names, data_dir, plan, command=command)
    return path, tokenizer, shots, train, held_out, resolve_tasks(names, data_dir, shots=shots, limit=limits)


def task_plan(eval_tasks: str, plan: Budget, limit=None) -> tuple[list[str], dict, dict]:
    """(task names, items per task, shots per task): the budget's, with ``limit`` (N, or per task) over it."""
    from .calibration.tasks import parse_per_task, parse_task_names

    names = parse_task_names(eval_tasks)
    limits = {n: plan.limits.get(n, 200 if plan.name != "tiny" else 8) for n in names}
    if limit is not None:
        limits.update({k: v for k, v in parse_per_task(limit, names, "limit", allow_zero=False).items() if v})
    return names, limits, {n: plan.shots.get(n, 0) for n in names}


def instruction_split(dataset: str | None, task_names: list[str], data_dir: str | None, plan: Budget,
                      command: str = "demo") -> tuple[list[dict], list[dict]]:
    """(SFT records, held-out records) of the instruction data (default TriviaQA + NQ-Open as instructions),
    refused when it overlaps the evaluation tasks, cut to the budget."""
    from .data import check_disjoint, load_instruction_records

    check_disjoint(dataset or DEFAULT_DATA, task_names)
    records = load_instruction_records(dataset or DEFAULT_DATA, data_dir=data_dir if dataset else None)
    if plan.records is not None:
        records = records[: plan.records + plan.calibration_records]
    n_cal = min(plan.calibration_records, max(1, len(records) // 5))
    if len(records) < 2 * n_cal:
        raise ValueError(f"{dataset or DEFAULT_DATA} gives {len(records)} records; the {command} needs at least "
                         f"{2 * n_cal} (training and a held-out split)")
    return records[:-n_cal], records[-n_cal:]


def sft(path, tokenizer, train, eval_records, callback_task, *, label_smoothing, budget: Budget, output_dir, seed):
    """One short fine-tuning from the checkpoint at ``path`` through ``apply_lsce_patch`` and TRL's ``SFTTrainer`` at
    ``label_smoothing``, with ``CalibrationCallback`` watching ``callback_task``: (the model in eval mode, its record:
    the callback's history, the training losses, seconds)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, set_seed
    from trl import SFTConfig, SFTTrainer

    from . import apply_lsce_patch
    from .calibration import CalibrationCallback

    set_seed(seed)
    dev = device()
    model = apply_lsce_patch(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    steps = budget.sft_steps
    args = SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=budget.batch_size,
                     per_device_eval_batch_size=budget.batch_size, learning_rate=budget.lr, lr_scheduler_type="constant",
                     warmup_steps=0, label_smoothing_factor=label_smoothing, logging_steps=max(1, steps // 10),
                     eval_strategy="steps", eval_steps=max(1, steps // 2), save_strategy="no", report_to="none",
                     seed=seed, use_cpu=dev.type == "cpu", bf16=budget.bf16 and dev.type == "cuda",
                     max_length=budget.max_length, completion_only_loss=True, disable_tqdm=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(train),
                         eval_dataset=Dataset.from_list(eval_records), processing_class=tokenizer)
    cb = CalibrationCallback([callback_task], n_bins=10, batch_size=16, tokenizer=tokenizer,
                             save_diagrams=False).attach(trainer)
    t0 = time.perf_counter()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer.model.eval(), {"history": cb.history, "train_loss": losses,
                                  "seconds": round(time.perf_counter() - t0, 1)}
