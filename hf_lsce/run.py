"""Run an unmodified HF / TRL training script with every supported model class patched.

    hf-lsce run train.py --label_smoothing_factor 0.1 ...
    python -m hf_lsce.run train.py --label_smoothing_factor 0.1 ...

The script's own ``--label_smoothing_factor`` then drives the fused op (see hf_lsce.patching.trainer).
"""
from __future__ import annotations

import logging
import os
import runpy
import sys


def run_script(script: str, args: list[str]) -> None:
    from .patching import apply_lsce_patch

    if not os.path.isfile(script):
        raise SystemExit(f"hf-lsce run: no such script: {script}")
    log = logging.getLogger("hf_lsce")
    if not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[hf_lsce] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
    apply_lsce_patch()
    log.info("patched every supported model class; the script's --label_smoothing_factor drives the fused op")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__)
        raise SystemExit(0)
    run_script(argv[0], argv[1:])


if __name__ == "__main__":
    main()
