"""Multiple-choice tasks for calibration: MMLU, HellaSwag, ARC-Easy, ARC-Challenge.

Each loader reads either local files in the published formats (``data_dir``) or, for users with
hub access, the hub dataset (``data_dir=None``). Two kinds of task:

* ``"letters"`` (MMLU, the original protocol of Hendrycks et al.): the prompt ends in ``Answer:``
  and the model's next-token distribution is restricted to the answer letters `` A``.. `` D``.
* ``"continuation"`` (HellaSwag, ARC; lm-evaluation-harness conventions): each choice is a
  continuation of the context, scored by its summed log-likelihood.
"""
from __future__ import annotations

import csv
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

logger = logging.getLogger(__name__)

LETTERS = ("A", "B", "C", "D", "E", "F", "G", "H")
MMLU_HEADER = "The following are multiple choice questions (with answers) about {subject}.\n\n"


@dataclass
class MultipleChoiceItem:
    """One question. ``render(k)`` is the text the model reads: header, ``k`` shots, then context.

    For a ``letters`` task ``choices`` are the answer options (shown in the prompt) and the model
    picks a letter; for a ``continuation`` task ``choices`` are the continuations it scores.
    """

    context: str
    choices: list[str]
    gold: int
    subject: str | None = None
    header: str = ""
    shots: list[str] = field(default_factory=list)

    def render(self, k: int | None = None) -> str:
        shots = self.shots if k is None else self.shots[:k]
        return self.header + "".join(shots) + self.context


@dataclass
class Task:
    """A named list of items and how to score them (``kind`` is "letters" or "continuation")."""

    name: str
    kind: str
    items: list[MultipleChoiceItem]

    def __post_init__(self):
        if self.kind not in ("letters", "continuation"):
            raise ValueError(f"Task `kind` must be 'letters' or 'continuation'; got {self.kind!r}")
        if not self.items:
            raise ValueError(f"task {self.name!r} has no items; check the data files or the `limit`")
        for i, it in enumerate(self.items):
            if not 0 <= it.gold < len(it.choices):
                raise ValueError(f"task {self.name!r} item {i}: gold index {it.gold} is outside its "
                                 f"{len(it.choices)} choices")
            if self.kind == "letters" and len(it.choices) > len(LETTERS):
                raise ValueError(f"task {self.name!r} item {i}: at most {len(LETTERS)} lettered choices")

    def __len__(self) -> int:
        return len(self.items)


# ------------------------------------------------------------------------------------------ MMLU
def mmlu_format_question(question: str, choices: list[str], answer: int | None = None) -> str:
    """One MMLU question as in Hendrycks et al.'s ``format_example``; with ``answer``, a shot."""
    text = question + "".join(f"\n{LETTERS[j]}. {c}" for j, c in enumerate(choices)) + "\nAnswer:"
    if answer is not None:
        text += f" {LETTERS[answer]}\n\n"
    return text


def _read_mmlu_csv(path: str) -> list[tuple[str, list[str], int]]:
    """Rows of an MMLU CSV: the header-less original (``question,A,B,C,D,letter``) or the
    headed variant (``question,choice0..3,answer`` with an int answer)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if rows and [c.strip().lower() for c in rows[0]][:1] == ["question"] and rows[0][-1].strip().lower() == "answer":
        rows = rows[1:]
    out = []
    for i, r in enumerate(rows):
        if len(r) < 4:
            raise ValueError(f"{path}: row {i + 1} has {len(r)} columns; expected question, choices, answer")
        ans = r[-1].strip()
        if ans.upper() in LETTERS:
            gold = LETTERS.index(ans.upper())
        elif ans.isdigit():
            gold = int(ans)
        else:
            raise ValueError(f"{path}: row {i + 1} answer {ans!r} is neither a letter A-D nor an index 0-3")
        out.append((r[0], list(r[1:-1]), gold))
    return out


def _mmlu_dir(data_dir: str) -> str:
    for cand in (os.path.join(data_dir, "mmlu"), data_dir):
        if os.path.isdir(os.path.join(cand, "test")):
            return cand
    raise FileNotFoundError(f"no MMLU files under {data_dir!r}: expected {data_dir}/mmlu/test/<subject>_test.csv "
                            "and .../dev/<subject>_dev.csv (the original MMLU data layout)")


def load_mmlu(data_dir: str | None = None, *, shots: int = 5, split: str = "test",
              subjects: Iterable[str] | None = None) -> list[MultipleChoiceItem]:
    """MMLU, original protocol: ``shots`` examples from the first rows of the subject's dev split."""
    by_subject: dict[str, tuple[list, list]] = {}
    if data_dir is not None:
        root = _mmlu_dir(data_dir)
        split_dir = os.path.join(root, split)
        if not os.path.isdir(split_dir):
            raise FileNotFoundError(f"no MMLU split folder {split_dir!r}")
        for fn in sorted(os.listdir(split_dir)):
            m = re.fullmatch(rf"(.+)_{split}\.csv", fn)
            if not m:
                continue
            subj = m.group(1)
            dev_path = os.path.join(root, "dev", f"{subj}_dev.csv")
            dev = _read_mmlu_csv(dev_path) if shots and os.path.exists(dev_path) else []
            if shots and not dev:
                raise FileNotFoundError(f"{shots}-shot MMLU needs {dev_path}; pass shots=0 for zero-shot")
            by_subject[subj] = (_read_mmlu_csv(os.path.join(split_dir, fn)), dev)
    else:
        ds = _hub("cais/mmlu", "all")
        grouped: dict[str, dict[str, list]] = {}
        for part in (split, "dev") if shots else (split,):  # one pass over each split
            for r in ds[part]:
                grouped.setdefault(part, {}).setdefault(r["subject"], []).append(
                    (r["question"], r["choices"], int(r["answer"])))
        for subj in sorted(grouped[split]):
            by_subject[subj] = (grouped[split][subj], grouped.get("dev", {}).get(subj, []))
    if subjects is not None:
        wanted = set(subjects)
        missing = wanted - set(by_subject)
        if missing:
            raise ValueError(f"unknown MMLU subjects {sorted(missing)}; known: {sorted(by_subject)}")
        by_subject = {s: v for s, v in by_subject.items() if s in wanted}
    items = []
    for subj, (rows, dev) in by_subject.items():
        header = MMLU_HEADER.format(subject=subj.replace("_", " "))
        shot_texts = [mmlu_format_question(q, c, a) for q, c, a in dev[:shots]]
        for q, c, a in rows:
            items.append(MultipleChoiceItem(context=mmlu_format_question(q, c), choices=c, gold=a,
                                            subject=subj, header=header, shots=shot_texts))
    return items


# ------------------------------------------------------------------------------------- HellaSwag
def _hellaswag_preprocess(text: str) -> str:
    # lm-evaluation-harness's cleaning of WikiHow artefacts
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag_item(row: dict) -> MultipleChoiceItem:
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return MultipleChoiceItem(context=_hellaswag_preprocess(row["activity_label"] + ": " + ctx),
                              choices=[" " + _hellaswag_preprocess(e) for e in row["endings"]],
                              gold=int(row["label"]), subject=row.get("activity_label"))


def load_hellaswag(data_dir: str | None = None, *, split: str = "validation") -> list[MultipleChoiceItem]:
    """HellaSwag as lm-evaluation-harness scores it (context ``label: ctx``, endings as continuations)."""
    if data_dir is not None:
        rows = _read_jsonl(_find(data_dir, ["hellaswag/hellaswag_val_1k.jsonl", "hellaswag/hellaswag_val.jsonl",
                                            "hellaswag_val.jsonl", "hellaswag.jsonl"], "HellaSwag"),
                           required=("ctx_a", "ctx_b", "activity_label", "endings", "label"))
    else:
        rows = list(_hub("Rowan/hellaswag")[split])
    return [_hellaswag_item(r) for r in rows]


# ------------------------------------------------------------------------------------------- ARC
def load_arc(data_dir: str | None = None, *, challenge: bool = False, split: str = "test") -> list[MultipleChoiceItem]:
    """ARC as lm-evaluation-harness scores it: ``Question: ...\\nAnswer:`` and `` choice`` continuations.

    Local files: llm-foundry's JSONL (``query``, ``choices``, ``gold``) or the original ARC JSONL
    (``question.stem``, ``question.choices``, ``answerKey``)."""
    name = "challenge" if challenge else "easy"
    items = []
    if data_dir is not None:
        path = _find(data_dir, [f"arc/arc_{name}_{split}.jsonl", f"arc_{name}_{split}.jsonl"], f"ARC-{name}")
        for r in _read_jsonl(path, required=()):
            if "query" in r:
                q, ch, gold = r["query"], r["choices"], int(r["gold"])
            elif "question" in r and isinstance(r["question"], dict):
                labels = [c["label"] for c in r["question"]["choices"]]
                q, ch = "Question: " + r["question"]["stem"], [c["text"] for c in r["question"]["choices"]]
                gold = labels.index(r["answerKey"])
            else:
                raise ValueError(f"{path}: rows need `query`/`choices`/`gold` (llm-foundry) or `question`/"
                                 "`answerKey` (original ARC)")
            items.append(_arc_item(q, ch, gold))
    else:
        ds = _hub("allenai/ai2_arc", "ARC-Challenge" if challenge else "ARC-Easy")[split]
        for r in ds:
            items.append(_arc_item("Question: " + r["question"], r["choices"]["text"],
                                   r["choices"]["label"].index(r["answerKey"])))
    return items


def _arc_item(query: str, choices: list[str], gold: int) -> MultipleChoiceItem:
    q = query if query.startswith("Question:") else "Question: " + query
    if not q.rstrip().endswith("Answer:"):
        q = q + "\nAnswer:"
    return MultipleChoiceItem(context=q, choices=[" " + c for c in choices], gold=gold)


# ------------------------------------------------------------------------------------------ glue
def _read_jsonl(path: str, required: tuple[str, ...]) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                r = json.loads(line)
                miss = [k for k in required if k not in r]
                if miss:
                    raise ValueError(f"{path}: line {i + 1} lacks the columns {miss}")
                rows.append(r)
    return rows


def _find(data_dir: str, candidates: list[str], what: str) -> str:
    for c in candidates:
        p = os.path.join(data_dir, c)
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"no {what} file under {data_dir!r}; looked for: {', '.join(candidates)}")


def _hub(name: str, config: str | None = None):
    try:
        import datasets

        return datasets.load_dataset(name, config)
    except Exception as e:  # offline, no such dataset, ...
        raise RuntimeError(f"could not load {name!r} from the Hugging Face hub ({type(e).__name__}: {e}). "
                           "Without hub access pass `data_dir` (CLI: --data-dir) pointing at local files") from e


TASKS: dict[str, tuple[str, Callable[..., list[MultipleChoiceItem]]]] = {
    "mmlu": ("letters", lambda d, shots, split: load_mmlu(d, shots=shots, split=split or "test")),
    "hellaswag": ("continuation", lambda d, shots, split: load_hellaswag(d, split=split or "validation")),
    "arc_easy": ("continuation", lambda d, shots, split: load_arc(d, challenge=False, split=split or "test")),
    "arc_challenge": ("continuation", lambda d, shots, split: load_arc(d, challenge=True, split=split or "test")),
}


def _interleave(items: list[MultipleChoiceItem]) -> list[MultipleChoiceItem]:
    """Round-robin over subjects, so that the first ``limit`` items span every subject."""
    groups: dict = {}
    for it in items:
        groups.setdefault(it.subject, []).append(it)
    out, lists = [], list(groups.values())
    for i in range(max(len(g) for g in lists)):
        out.extend(g[i] for g in lists if i < len(g))
    return out


def load_task(name: str, data_dir: str | None = None, *, shots: int = 5, limit: int | None = None,
              split: str | None = None) -> Task:
    """Load a task by name (``mmlu``, ``hellaswag``, ``arc_easy``, ``arc_challenge``).

    ``shots`` applies to MMLU (HellaSwag and ARC are zero-shot, the harness default). ``limit``
    keeps the first items; for MMLU they are taken round-robin over subjects.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)} or build a `Task` yourself")
    if not isinstance(shots, int) or shots < 0:
        raise ValueError(f"`shots` must be a non-negative integer; got {shots!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ValueError(f"`limit` must be a positive integer or None; got {limit!r}")
    kind, loader = TASKS[name]
    items = loader(data_dir, shots, split)
    if name == "mmlu":
        items = _interleave(items)
    if limit is not None:
        items = items[:limit]
    return Task(name=name, kind=kind, items=items)


def parse_task_names(spec: str | Iterable[str]) -> list[str]:
    """``"mmlu,arc_easy"`` or a list -> validated names (``arc`` means both ARC sets)."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out = []
    for n in names:
        if not n:
            continue
        out.extend(["arc_easy", "arc_challenge"] if n == "arc" else [n])
    bad = [n for n in out if n not in TASKS]
    if bad:
        raise ValueError(f"unknown task names {bad}; choose from {sorted(TASKS)} (or 'arc' for both ARC sets)")
    if not out:
        raise ValueError("no task names given")
    return out


def resolve_tasks(tasks, data_dir: str | None = None, *, shots: int = 5, limit: int | None = None) -> list[Task]:
    """Task names (``"mmlu,arc"`` or a list) and/or ``Task`` objects -> loaded ``Task`` objects."""
    if isinstance(tasks, (str, Task)):
        tasks = [tasks]
    out: list[Task] = []
    for t in tasks:
        if isinstance(t, Task):
            out.append(t)
        elif isinstance(t, str):
            out.extend(load_task(n, data_dir, shots=shots, limit=limit) for n in parse_task_names(t))
        else:
            raise TypeError(f"`tasks` entries must be task names or Task objects; got {type(t).__name__}")
    if not out:
        raise ValueError("`tasks` is empty: name at least one task (e.g. 'mmlu') or pass a Task")
    return out
