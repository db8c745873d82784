"""``CalibrationCallback``: score held-out multiple-choice sets at every evaluation and log calibration."""
from __future__ import annotations

import json
import logging
import os

from transformers import TrainerCallback

from .plots import reliability_diagram
from .scoring import TaskScores, check_scoring_args, score_task
from .tasks import Task, resolve_tasks

logger = logging.getLogger(__name__)


class CalibrationCallback(TrainerCallback):
    """At each evaluation, score ``tasks`` and log ``<prefix>/<task>_<metric>`` (acc, ece, rms, ...).

    Args:
        tasks: task names (``"mmlu,arc_easy"`` or a list) and/or ``Task`` objects (your own
            held-out split). Names are loaded now, so a missing file fails before training starts.
        data_dir: local data folder for named tasks (``None``: the Hugging Face hub).
        tokenizer: defaults to the trainer's ``processing_class``.
        shots, limit: as :func:`~hf_lsce.calibration.tasks.resolve_tasks`: one value or per task
            (``limit`` items per task; ``shots`` None: each task's default, MMLU 5, others 0).
        split, subjects: as :func:`~hf_lsce.calibration.load_task`.
        n_bins, batch_size: binning and scoring batch size.
        chat_template: score through the tokenizer's chat template (instruct models).
        prefix: metric key prefix; the default ``eval_calib`` groups the keys under ``eval/`` in
            W&B and TensorBoard.
        save_diagrams: write ``<output_dir>/calibration/<task>_step<N>.png`` and a JSON of every
            evaluation (main process only).
        trainer: the trainer, or call :meth:`attach`. With it the metrics go through
            ``trainer.log`` (so every reporting integration sees them, at the right step); without
            it they are added to the dict ``trainer.evaluate()`` returns and to ``state.log_history``.
        at_train_begin: also score before the first step, to log the starting calibration.

    Under several processes every rank scores a shard of each task and the results are gathered.
    """

    def __init__(self, tasks, *, data_dir: str | None = None, tokenizer=None, shots=None,
                 limit=200, n_bins: int = 15, batch_size: int = 8, prefix: str = "eval_calib",
                 save_diagrams: bool = True, trainer=None, at_train_begin: bool = False, split: str | None = None,
                 subjects=None, chat_template: bool = False):
        check_scoring_args(batch_size=batch_size, n_bins=n_bins)  # now, not at the first evaluation
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"`prefix` must be a non-empty string; got {prefix!r}")
        self.tasks: list[Task] = resolve_tasks(tasks, data_dir, shots=shots, limit=limit, split=split, subjects=subjects)
        self.tokenizer, self.n_bins, self.batch_size = tokenizer, n_bins, batch_size
        self.chat_template = bool(chat_template)
        self.prefix, self.save_diagrams, self.at_train_begin = prefix, save_diagrams, at_train_begin
        self.trainer = trainer
        self.history: list[dict] = []
        self._last_step = None
        self._warned = False

    def attach(self, trainer) -> "CalibrationCallback":
        """Bind to ``trainer`` (so metrics go through ``trainer.log``) and register as its callback."""
        self.trainer = trainer
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    # ------------------------------------------------------------------------------ the events
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if self.at_train_begin:
            self._run(args, state, model, processing_class, None)

    def on_evaluate(self, args, state, control, model=None, processing_class=None, metrics=None, **kwargs):
        if self._last_step == state.global_step:  # several eval datasets: score once per evaluation
            return
        self._run(args, state, model, processing_class, metrics)

    # ------------------------------------------------------------------------------- the work
    def _run(self, args, state, model, processing_class, metrics):
        tok = self.tokenizer or processing_class
        tok = getattr(tok, "tokenizer", tok)  # a processor wraps the tokenizer
        if tok is None:
            raise ValueError("CalibrationCallback needs a tokenizer: pass `tokenizer=` or give the trainer a "
                             "`processing_class`")
        self._last_step = state.global_step
        results: dict[str, TaskScores] = {}
        for t in self.tasks:
            results[t.name] = score_task(model, tok, t, batch_size=self.batch_size, n_bins=self.n_bins,
                                         progress=state.is_local_process_zero, chat_template=self.chat_template)
        logs = {f"{self.prefix}/{name}_{k}": v for name, r in results.items() for k, v in r.summary().items()
                if k not in ("n", "n_bins")}
        self.history.append({"step": state.global_step, **logs})
        if self.trainer is not None:
            self.trainer.log(dict(logs))
        else:
            if not self._warned and state.is_world_process_zero:
                logger.warning("CalibrationCallback is not attached to the trainer: its metrics reach the dict "
                               "evaluate() returns and state.log_history, but not W&B/TensorBoard. Use "
                               "CalibrationCallback(...).attach(trainer)")
                self._warned = True
            state.log_history.append({**logs, "step": state.global_step})
        if metrics is not None:
            metrics.update(logs)
        if self.save_diagrams and state.is_world_process_zero and args is not None and args.output_dir:
            out = os.path.join(args.output_dir, "calibration")
            os.makedirs(out, exist_ok=True)
            for name, r in results.items():
                reliability_diagram(r.metrics, os.path.join(out, f"{name}_step{state.global_step}.png"),
                                    title=f"{name}, step {state.global_step}")
            with open(os.path.join(out, "history.json"), "w") as f:
                json.dump(self.history, f, indent=1)
        return results
