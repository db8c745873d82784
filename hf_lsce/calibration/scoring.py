"""Score multiple-choice tasks with any causal LM and measure its calibration.

Requests are tokenised once, sorted by length and run in left-padded batches, so every sequence
ends at the same position and only the last few positions' logits are asked for (``logits_to_keep``
where the model's forward takes it): a 5-shot MMLU batch never holds a full sequence x vocabulary
tensor. Position ids are passed from the attention mask, so models with absolute positions read
padded rows correctly.

Confidence, and so calibration, is the softmax over the choices of the model's scores:
* letters tasks (MMLU): the next-token logits restricted to the answer letters;
* continuation tasks (HellaSwag, ARC): the summed log-likelihood of each continuation, i.e. the
  model's joint probability of the choices renormalised over them. The prediction measured is
  ``acc`` (argmax of that same score); ``acc_norm`` (the log-likelihood divided by the number of
  characters of the choice *without* its leading delimiter space, as lm-evaluation-harness computes it)
  is reported beside it but does not enter the calibration. Items may have different numbers of choices.

``chat_template=True`` renders each prompt (header, shots and question) as one user message through the
tokenizer's chat template with the generation prompt, and the answer follows it without the delimiter
space (`` A`` becomes ``A``). lm-evaluation-harness scores without it unless asked; so does this module,
with a warning when the tokenizer has a chat template (an instruct model).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from .metrics import CalibrationResult, calibration_metrics
from .tasks import LETTERS, Task, resolve_tasks

logger = logging.getLogger(__name__)


@dataclass
class TaskScores:
    """A task's per-item choice probabilities, labels and metrics."""

    task: str
    probs: torch.Tensor          # (items, choices): softmax over the choices (padded with 0)
    labels: torch.Tensor         # (items,)
    loglik: torch.Tensor         # (items, choices): raw scores (-inf padding)
    acc_norm: float | None
    metrics: CalibrationResult
    shots_used: list[int] = field(default_factory=list, repr=False)
    loglik_at: dict = field(default_factory=dict, repr=False)  # temperature -> (items, choices) scores

    def probs_at(self, temperature: float) -> torch.Tensor:
        """The choice probabilities had every next-token distribution been softmax(logits / temperature):
        scored in the same pass (``score_task(temperatures=...)``)."""
        if temperature == 1.0:
            return self.probs
        if temperature not in self.loglik_at:
            raise KeyError(f"temperature {temperature} was not scored; pass it in score_task(temperatures=...)")
        return torch.softmax(self.loglik_at[temperature], -1).float()

    def summary(self) -> dict[str, float]:
        d = {"acc": self.metrics.accuracy, **{k: v for k, v in self.metrics.scalars().items() if k != "accuracy"}}
        d["n"] = int(self.metrics.n)
        if self.acc_norm is not None:
            d["acc_norm"] = self.acc_norm
        return d


def _model_max_length(model, tokenizer, max_length: int | None) -> int:
    if max_length:
        return max_length
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    m = getattr(cfg, "max_position_embeddings", None)
    t = getattr(tokenizer, "model_max_length", None)
    cands = [x for x in (m, t) if isinstance(x, int) and 0 < x < 10**7]
    return min(cands) if cands else 2048


def _encode(tokenizer, text: str, special: bool = True) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _chat(tokenizer, prompt: str) -> str:
    """``prompt`` as one user turn through the chat template, ending with the assistant's generation prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def _letter_ids(tokenizer, prompt: str, n: int, delimiter: str = " ", special: bool = True) -> list[int]:
    """Token id of `` A``, `` B``, ... as they follow ``Answer:`` (the original MMLU protocol)."""
    base = _encode(tokenizer, prompt, special)
    ids = []
    for letter in LETTERS[:n]:
        whole = _encode(tokenizer, prompt + delimiter + letter, special)
        if whole[: len(base)] != base or len(whole) != len(base) + 1:
            raise ValueError(f"the tokenizer does not encode {delimiter + letter!r} after the prompt as one token; the "
                             "MMLU letter protocol needs single-token answer letters")
        ids.append(whole[-1])
    if len(set(ids)) != len(ids):
        raise ValueError("the tokenizer maps different answer letters to the same token")
    return ids


def _forward_kwargs(model) -> set[str]:
    fwd = getattr(model, "forward", model)
    try:
        return set(inspect.signature(fwd).parameters)
    except (TypeError, ValueError):
        return set()


@torch.no_grad()
def _last_logits(model, batch_ids: list[list[int]], keep: int, pad_id: int, device, accepted: set[str]) -> torch.Tensor:
    """Logits of the last ``keep`` positions of left-padded sequences: (B, keep, V) in fp32."""
    L = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch_ids), L), dtype=torch.long)
    for i, x in enumerate(batch_ids):
        ids[i, L - len(x):] = torch.tensor(x)
        mask[i, L - len(x):] = 1
    kw = dict(input_ids=ids.to(device), attention_mask=mask.to(device))
    if "position_ids" in accepted:
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp_min(0).to(device)
    if "logits_to_keep" in accepted:
        kw["logits_to_keep"] = keep
    if "use_cache" in accepted:
        kw["use_cache"] = False
    out = model(**kw)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits[:, -keep:].float()


def _device_of(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _shard(n: int, distributed: bool) -> tuple[list[int], int, int]:
    import torch.distributed as dist

    if distributed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        r, w = dist.get_rank(), dist.get_world_size()
        return list(range(r, n, w)), r, w
    return list(range(n)), 0, 1


def _check_token_ids(model, requests, letter_ids) -> None:
    """Every token id the tokenizer produced must have a row in the model's embeddings: a larger tokenizer (another
    model's) would otherwise end in an IndexError inside the embedding lookup."""
    try:
        embed = model.get_input_embeddings()
    except Exception:  # noqa: BLE001 - a model without (reachable) input embeddings: nothing to check against
        return
    vocab = getattr(embed, "num_embeddings", None)
    if vocab is None:
        return
    top = max([max(r[2]) for r in requests if r[2]] + list(letter_ids or []), default=-1)
    if top >= vocab:
        raise ValueError(f"the tokenizer produced token id {top}, but the model's embeddings have {vocab} rows: the "
                         "tokenizer does not belong to this model. Pass the model's own tokenizer "
                         "(AutoTokenizer.from_pretrained on the same checkpoint), or resize the model's embeddings.")


def score_task(model, tokenizer, task: Task, *, batch_size: int = 8, max_length: int | None = None,
               n_bins: int = 15, progress: bool = True, distributed: bool = True,
               chat_template: bool = False, temperatures=()) -> TaskScores:
    """Score every item of ``task`` with ``model`` and measure calibration.

    Works with any causal LM returning ``.logits`` (patched or not; an ``ATSCalibrator`` returns
    calibrated logits). Few-shot prompts longer than the model's context drop shots from the end
    until they fit. Under ``torch.distributed`` each rank scores a shard and the results are
    gathered, so every rank returns the same ``TaskScores``. ``chat_template``: see the module docstring.
    ``temperatures``: also score every choice as if each next-token distribution were softmax(logits / T), in the
    same forward passes (``TaskScores.probs_at(T)``; what ``hf_lsce.diagnosis`` asks "what if the model were
    less confident").
    """
    check_scoring_args(task=task, batch_size=batch_size, n_bins=n_bins, max_length=max_length)
    temps = [float(t) for t in temperatures]
    if any(not (t > 0 and t < float("inf")) for t in temps):
        raise ValueError(f"`temperatures` must be finite numbers > 0; got {list(temperatures)!r}")
    temps = [t for t in dict.fromkeys(temps) if t != 1.0]
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError("chat_template=True but the tokenizer has no chat template (a base model?); score without it")
    if has_template and not chat_template and not getattr(tokenizer, "_lsce_warned_template", False):
        logger.warning("the tokenizer has a chat template (an instruct model?) but %s is scored without it, as "
                       "lm-evaluation-harness does by default; pass chat_template=True (CLI: --chat-template) to "
                       "score through it", task.name)
        try:
            tokenizer._lsce_warned_template = True
        except AttributeError:  # pragma: no cover - a tokenizer that refuses attributes
            pass
    device = _device_of(model)
    accepted = _forward_kwargs(model)
    max_len = _model_max_length(model, tokenizer, max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    mine, rank, world = _shard(len(task.items), distributed)

    # --- tokenise into requests: (item, choice, ids, n_continuation_tokens)
    requests, shots_used = [], {}
    letter_ids = None
    special = not chat_template  # a chat-templated string carries its own special tokens
    for i in mine:
        it = task.items[i]
        k = len(it.shots)
        while True:
            prompt = _chat(tokenizer, it.render(k)) if chat_template else it.render(k)
            ctx = _encode(tokenizer, prompt, special)
            if task.kind == "letters":
                full, conts = [ctx], [0]
            else:
                full, conts = [], []
                for c in it.choices:
                    whole = _encode(tokenizer, prompt + (c[1:] if chat_template and c.startswith(" ") else c), special)
                    n_cont = max(1, len(whole) - len(ctx))  # the harness's split: whole[len(ctx):]
                    full.append(whole)
                    conts.append(n_cont)
            if max(len(x) for x in full) <= max_len or k == 0:
                break
            k -= 1
        if max(len(x) for x in full) > max_len:
            raise ValueError(f"task {task.name!r} item {i} is {max(len(x) for x in full)} tokens even without "
                             f"shots; the model takes {max_len}. Raise `max_length` or drop the item")
        shots_used[i] = k
        if task.kind == "letters" and letter_ids is None:
            letter_ids = _letter_ids(tokenizer, prompt, max(len(x.choices) for x in task.items),
                                     "" if chat_template else " ", special)
        for j, (ids, n_cont) in enumerate(zip(full, conts)):
            requests.append((i, j, ids, n_cont))

    _check_token_ids(model, requests, letter_ids)
    n_choices = max(len(it.choices) for it in task.items)
    scores = {i: torch.full((n_choices,), float("-inf"), dtype=torch.float64) for i in mine}
    at = {t: {i: torch.full((n_choices,), float("-inf"), dtype=torch.float64) for i in mine} for t in temps}
    order = sorted(range(len(requests)), key=lambda r: -len(requests[r][2]))
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        bar = tqdm(range(0, len(order), batch_size), desc=f"scoring {task.name}", disable=not progress or rank != 0,
                   leave=False)
        for s in bar:
            batch = [requests[r] for r in order[s: s + batch_size]]
            keep = 1 if task.kind == "letters" else max(b[3] for b in batch) + 1
            logits = _last_logits(model, [b[2] for b in batch], keep, pad_id, device, accepted)
            logp = torch.log_softmax(logits, -1) if task.kind != "letters" else None
            logp_at = {t: torch.log_softmax(logits / t, -1) for t in temps} if task.kind != "letters" else {}
            for row, (i, j, ids, n_cont) in enumerate(batch):
                if task.kind == "letters":
                    sel = logits[row, -1, letter_ids[: len(task.items[i].choices)]].double().cpu()
                    scores[i][: sel.numel()] = sel
                    for t in temps:  # softmax over the letters of logits / t
                        at[t][i][: sel.numel()] = sel / t
                else:
                    tgt = torch.tensor(ids[-n_cont:], device=logp.device)
                    pos = torch.arange(keep - n_cont - 1, keep - 1, device=logp.device)
                    scores[i][j] = float(logp[row, pos, tgt].double().sum())
                    for t in temps:
                        at[t][i][j] = float(logp_at[t][row, pos, tgt].double().sum())
    finally:
        if was_training and hasattr(model, "train"):
            model.train()

    # --- gather the shards
    mine_rows = [(i, scores[i], shots_used[i], [at[t][i] for t in temps]) for i in mine]
    if world > 1:
        import torch.distributed as dist

        parts = [None] * world
        dist.all_gather_object(parts, mine_rows)
        mine_rows = [r for p in parts for r in p]
    mine_rows.sort(key=lambda r: r[0])
    loglik = torch.stack([r[1] for r in mine_rows])
    loglik_at = {t: torch.stack([r[3][k] for r in mine_rows]) for k, t in enumerate(temps)}
    return _task_scores(task, [r[0] for r in mine_rows], loglik, n_bins, [r[2] for r in mine_rows], loglik_at)


def _task_scores(task: Task, items: list[int], loglik: torch.Tensor, n_bins: int, shots_used: list[int],
                 loglik_at: dict) -> TaskScores:
    """``TaskScores`` of the scored ``items`` (indices into ``task.items``) from their choices' log-likelihoods."""
    labels = torch.tensor([task.items[i].gold for i in items])
    probs = torch.softmax(loglik, -1)  # -inf padding -> probability 0
    acc_norm = None
    if task.kind == "continuation":
        normed = torch.full_like(loglik, float("-inf"))  # padding (items with fewer choices) stays -inf, never NaN
        for row, i in enumerate(items):
            ch = task.items[i].choices
            lens = torch.tensor([float(max(1, len(choice_length_text(c)))) for c in ch], dtype=torch.float64)
            normed[row, : len(ch)] = loglik[row, : len(ch)] / lens
        acc_norm = float((normed.argmax(-1) == labels).double().mean())
    metrics = calibration_metrics(probs, labels, n_bins=n_bins)
    return TaskScores(task=task.name, probs=probs.float(), labels=labels, loglik=loglik, acc_norm=acc_norm,
                      metrics=metrics, shots_used=shots_used, loglik_at=loglik_at)


def at_temperature(scores: TaskScores, task: Task, temperature: float, n_bins: int = 15) -> TaskScores:
    """The ``TaskScores`` of the model whose every next-token distribution is softmax(logits / ``temperature``)
    (classic temperature scaling, ``ATSCalibrator`` with ``head_type="scalar"``), from ``scores`` of the model itself
    scored with that temperature (``score_task(temperatures=...)``): no second pass over the items."""
    if temperature == 1.0:
        return scores
    if temperature not in scores.loglik_at:
        raise KeyError(f"temperature {temperature} was not scored; pass it in score_task(temperatures=...)")
    return _task_scores(task, list(range(len(task.items))), scores.loglik_at[temperature], n_bins,
                        scores.shots_used, {})


def choice_length_text(choice: str) -> str:
    """The text whose characters ``acc_norm`` divides by: the choice without its leading delimiter space
    (lm-evaluation-harness measures ``doc_to_choice``, which excludes the target delimiter)."""
    return choice[1:] if choice.startswith(" ") else choice


def check_scoring_args(*, task=None, batch_size=8, n_bins=15, max_length=None) -> None:
    """Validate scoring arguments before any work (a bad ``n_bins`` must not surface after a whole task)."""
    if task is not None and not isinstance(task, Task):
        raise TypeError(f"`task` must be a hf_lsce.calibration.Task (see load_task); got {type(task).__name__}")
    for name, v in (("batch_size", batch_size), ("n_bins", n_bins)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"`{name}` must be a positive integer; got {v!r}")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"`max_length` must be an integer >= 2 or None; got {max_length!r}")


def evaluate_calibration(model, tokenizer, tasks, *, data_dir: str | None = None, shots=None,
                         limit=None, batch_size: int = 8, n_bins: int = 15, progress: bool = True,
                         max_length: int | None = None, split: str | None = None, subjects=None,
                         chat_template: bool = False) -> dict[str, TaskScores]:
    """Load (names) or take (``Task`` objects) each task, score it, and return ``{name: TaskScores}``.
    ``shots`` / ``limit``: one value or per task (see :func:`~hf_lsce.calibration.tasks.resolve_tasks`)."""
    check_scoring_args(batch_size=batch_size, n_bins=n_bins, max_length=max_length)
    loaded = resolve_tasks(tasks, data_dir, shots=shots, limit=limit, split=split, subjects=subjects)
    return {t.name: score_task(model, tokenizer, t, batch_size=batch_size, n_bins=n_bins, progress=progress,
                               max_length=max_length, chat_template=chat_template) for t in loaded}
