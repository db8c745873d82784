"""The patch's tests on every transformers / TRL set the package claims, each in a virtual environment of its own, on
the CPU (CI runs the newest set only: `.ci/run`).

    python tools/version_matrix.py [--root /tmp/venvs] [--sets floor,llamafactory,axolotl,axolotl-newest] [--skip-install]

Sets (torch 2.13.0 CPU unless said):
  floor         transformers 4.57.1, TRL 0.24.0, PEFT 0.18.1, accelerate 1.11, datasets 4.0 (setup.cfg's floors)
  llamafactory  llamafactory 0.9.5 with its pins: transformers 5.6.0, TRL 0.24.0, PEFT 0.18.1 (torch 2.9.1: its
                torchaudio requirement has no build for 2.13)
  axolotl       axolotl 0.19.0 with its pins: transformers 5.16.1, TRL 1.9.0, PEFT 0.20.0
  axolotl-newest  axolotl 0.21.0 (the newest; it needs Python >= 3.12: python3.12 from PATH) with its pins:
                transformers 5.20.1, TRL 1.14.1, PEFT 0.21.2 (torch 2.13.0 from the registry, a CUDA build)
hf_lsce is installed into each with --no-deps (editable), then tests/test_patching.py, tests/test_training_matrix.py
and tests/test_integrations.py run there (Axolotl's plugin on Axolotl's own classes in the axolotl set). Then
tools/frameworks_e2e.py runs both frameworks' CLIs from the llamafactory and axolotl sets.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_DEPS = ["pytest", "pytest-xdist", "torchmetrics", "gguf", "matplotlib", "pydantic>=2"]
SETS = {
    "floor": [["torch==2.13.0"], ["transformers==4.57.1", "trl==0.24.0", "peft==0.18.1", "accelerate<=1.11",
                                   "datasets<=4.0.0", "evaluate", "tqdm", "torch==2.13.0", *TEST_DEPS]],
    "llamafactory": [["torch==2.9.1", "torchvision==0.24.1"], ["torch==2.9.1", "torchaudio==2.9.*"],
                     ["llamafactory==0.9.5", "torch==2.9.1", *TEST_DEPS]],
    "axolotl": [["torch==2.13.0"], ["axolotl==0.19.0", "torch==2.13.0", *TEST_DEPS]],
    "axolotl-newest": [["torch==2.13.0"], ["axolotl==0.21.0", "torch==2.13.0", *TEST_DEPS]],
}
PYTHONS = {"axolotl-newest": "python3.12"}  # the sets' Python where it is not this one
TESTS = ["tests/test_patching.py", "tests/test_training_matrix.py", "tests/test_integrations.py"]


def sh(cmd: list[str]) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/venvs", help="where the environments are made")
    p.add_argument("--sets", default="floor,llamafactory,axolotl,axolotl-newest")
    p.add_argument("--skip-install", action="store_true", help="reuse environments made before")
    args = p.parse_args(argv)
    names = args.sets.split(",")
    failed = []
    for name in names:
        env = Path(args.root) / name
        py = str(env / "bin" / "python")
        if not args.skip_install:
            if sh([PYTHONS.get(name, sys.executable), "-m", "venv", str(env)]) != 0:
                return 1
            for step in SETS[name]:
                if sh([py, "-m", "pip", "install", "-q", *step]) != 0:
                    return 1
            if sh([py, "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)]) != 0:
                return 1
        if sh([py, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", *TESTS]) != 0:
            failed.append(name)
    if {"llamafactory", "axolotl"} <= set(names):
        lf, ax = (str(Path(args.root) / n / "bin" / "python") for n in ("llamafactory", "axolotl"))
        if sh([sys.executable, "tools/frameworks_e2e.py", "--axolotl-python", ax, "--llamafactory-python", lf]) != 0:
            failed.append("frameworks_e2e")
    if "axolotl-newest" in names:
        ax = str(Path(args.root) / "axolotl-newest" / "bin" / "python")
        if sh([sys.executable, "tools/frameworks_e2e.py", "--axolotl-python", ax, "--out",
               "benchmarks/results/frameworks_e2e_axolotl_newest_cpu.json"]) != 0:
            failed.append("frameworks_e2e axolotl-newest")
    print("version matrix:", "failed: " + ", ".join(failed) if failed else "every set passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
