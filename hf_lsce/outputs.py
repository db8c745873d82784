"""Output folders that never cost the user a file.

Every command that writes a folder (``hf-lsce eval``, ``demo``, ``train-ats``, ``train_ats(...)``) goes
through :func:`output_folder`:

* a folder holding files hf_lsce did not write is refused unless ``overwrite`` (``--overwrite``): a model's
  own folder must not lose its weight shards to a save step that tidies the folder;
* a folder holding an earlier run's results is refused unless ``overwrite`` (or ``resume``, where a command
  can continue, as ``train-ats --resume``);
* a marker file (``.hf_lsce_run.json``) says which command wrote the folder and whether it finished. A run
  that fails or is interrupted is marked so (or, if it created the folder and left nothing to resume, the
  folder is removed): nothing a later run would trust is left looking finished. :func:`require_complete`
  lets loaders refuse such folders.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

MARKER = ".hf_lsce_run.json"


class OutputFolderError(FileExistsError):
    """The output folder holds something the command must not overwrite without being asked."""


def read_marker(path) -> dict | None:
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(path: Path, **info) -> None:
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path / MARKER)


def _listing(path: Path, n: int = 4) -> str:
    names = sorted(p.name for p in path.iterdir() if p.name != MARKER)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


@contextmanager
def output_folder(path, *, command: str, overwrite: bool = False, resume: bool = False,
                  resumable=lambda p: False):
    """Guard a folder ``command`` writes into (see the module docstring); yields its ``Path``.

    ``resume``: continue an earlier run of the same command in it. ``resumable(path)``: whether a failed run
    left something to resume (e.g. a Trainer checkpoint), in which case a folder it created is kept.
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise ValueError(f"the output folder must be a path; got {path!r}")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise NotADirectoryError(f"the output folder {p} is a file; choose a folder path")
    existed = p.exists()
    entries = [x for x in p.iterdir() if x.name != MARKER] if existed else []
    info = read_marker(p) if existed else None
    if resume:
        if info is None or info.get("command") != command:
            raise OutputFolderError(f"{p} holds no earlier `hf-lsce {command}` run to resume"
                                    + (f" (it holds {_listing(p)})" if entries else ""))
    elif entries and not overwrite:
        if info is None:
            raise OutputFolderError(
                f"{p} already holds files hf_lsce did not write ({_listing(p)}); choose another output folder, or "
                "pass --overwrite (overwrite=True) to write into it anyway")
        if info.get("status") == "complete":
            raise OutputFolderError(f"{p} holds the results of an earlier `hf-lsce {info.get('command')}`; pass "
                                    "--overwrite (overwrite=True) to replace them, or choose another output folder")
        hint = " --resume to continue it, or" if info.get("command") == command and command == "train-ats" else ""
        raise OutputFolderError(f"{p} holds an interrupted `hf-lsce {info.get('command')}` run ({info.get('status')}); "
                                f"pass{hint} --overwrite to start again, or choose another output folder")
    p.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    _write_marker(p, command=command, status="running", started=started)
    try:
        yield p
    except BaseException as e:
        if not existed and not resumable(p):
            shutil.rmtree(p, ignore_errors=True)  # nothing to keep, nothing to resume
        else:
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
            try:
                _write_marker(p, command=command, status=status, started=started, error=f"{type(e).__name__}: {e}"[:500])
            except OSError:
                pass
        raise
    _write_marker(p, command=command, status="complete", started=started,
                  finished=time.strftime("%Y-%m-%d %H:%M:%S"))


def require_complete(path) -> None:
    """Refuse a folder whose hf_lsce run did not finish (its files may be partial)."""
    info = read_marker(path) if os.path.isdir(str(path)) else None
    if info is not None and info.get("status") != "complete":
        raise ValueError(f"{path} holds an unfinished `hf-lsce {info.get('command')}` run ({info.get('status')}); its "
                         "files may be partial. Resume or re-run it first")
