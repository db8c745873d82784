"""Run an unmodified HF / TRL training script with every supported model class patched.

    hf-lsce run train.py --label_smoothing_factor 0.1 ...
    hf-lsce run -m trl.scripts.sft --model_name_or_path ... --label_smoothing_factor 0.1 ...
    python -m hf_lsce.run train.py ...

The script's own ``--label_smoothing_factor`` then drives the fused op (see hf_lsce.patching.trainer);
``HF_LSCE_LABEL_SMOOTHING=b`` in the environment fixes b instead (for scripts without the flag, or TRL
without its deprecated one); ``HF_LSCE_MEMORY`` sets the op's memory budget (``auto``, ``low`` or bytes, ``2e9``). Every training step checks that the fused op ran; the log says so after the
first one.
"""
from __future__ import annotations

import logging
import os
import runpy
import sys

USAGE = "usage: hf-lsce run SCRIPT.py [ARGS...]  |  hf-lsce run -m MODULE [ARGS...]"


class ConsoleHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted (not the stream of
    the moment it was made, which a caller that swaps stderr, e.g. a test harness, may have closed since)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ assigns it; the live sys.stderr wins
        pass


def _setup_logging() -> None:
    log = logging.getLogger("hf_lsce")
    if not log.handlers:
        h = ConsoleHandler()
        h.setFormatter(logging.Formatter("[hf_lsce] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def _smoothing_from_env(command: str) -> float | None:
    raw = os.environ.get("HF_LSCE_LABEL_SMOOTHING")
    if raw in (None, ""):
        return None
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{command}: HF_LSCE_LABEL_SMOOTHING must be a number in [0, 1], got {raw!r}.") from None


def patch_classes(command: str, memory=None) -> None:
    """Patch every supported model class (``apply_lsce_patch()``; ``HF_LSCE_LABEL_SMOOTHING`` fixes b, else the
    Trainer's ``label_smoothing_factor`` drives it; ``memory``, else ``HF_LSCE_MEMORY``, sets the op's memory budget)
    and route hf_lsce's log lines to the console; ``command`` names the caller in a one-line error."""
    from .patching import apply_lsce_patch, validate_memory

    b = _smoothing_from_env(command)
    name = "memory" if memory is not None else "HF_LSCE_MEMORY"
    try:
        memory = validate_memory(memory if memory is not None else os.environ.get("HF_LSCE_MEMORY") or "auto", name)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{command}: {e}") from None
    try:
        apply_lsce_patch(label_smoothing=b, memory=memory)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{command}: HF_LSCE_LABEL_SMOOTHING: {e}") from None
    _setup_logging()  # only once the run goes ahead: the process's logging is the script's from here on
    src = f"HF_LSCE_LABEL_SMOOTHING={b}" if b is not None else "the script's --label_smoothing_factor"
    logging.getLogger("hf_lsce").info("patched every supported model class; %s drives the fused op", src)


def run_script(script: str, args: list[str], module: bool = False) -> None:
    """Patch every supported class, then run ``script`` (a path, or a module name if ``module``) as
    ``__main__`` with ``args`` as its command line."""
    if module:
        import importlib.util

        try:
            found = importlib.util.find_spec(script)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise SystemExit(f"hf-lsce run: no module named {script!r} (is its package installed?)")
    elif not os.path.isfile(script):
        raise SystemExit(f"hf-lsce run: no such script: {script}")
    patch_classes("hf-lsce run")
    if module:
        sys.argv = [script, *args]
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(f"{USAGE}\n\n{__doc__}")
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(f"{USAGE}\n\n{__doc__}")
        raise SystemExit(0)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(f"hf-lsce run: -m needs a module name. {USAGE}")
        run_script(argv[1], argv[2:], module=True)
    else:
        run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main()
