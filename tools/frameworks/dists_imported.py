"""Which distributions a command imports that the GPU image lacks or holds at another version: the wheel lists of
tools/frameworks/*_gpu_wheels.txt. Runs CMD with a ``sitecustomize`` that writes, at each Python process's exit, the
top-level modules it imported (accelerate's and torchrun's children too: the variable is inherited); maps them to
distributions with the running environment's metadata; drops those the GPU image holds at the same version
(``--image-pins``: NAME==VERSION lines; names without a version in /work/.library/device/KINDS.md count as held at any
version unless pinned) and writes NAME==VERSION lines to ``--out`` (added to what it holds: run it once per YAML).

    PY=/tmp/py3.12/bin/python     # the framework's environment, its bin first on PATH
    $PY tools/frameworks/dists_imported.py --image-pins pins.txt --out list.txt -- axolotl train cfg.yml
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = """import atexit, os, sys
def _dump():
    with open(os.path.join({folder!r}, f"mods.{{os.getpid()}}.txt"), "w") as f:
        f.write("\\n".join(sorted({{m.split(".")[0] for m in list(sys.modules)}})))
atexit.register(_dump)
"""
KINDS = Path("/work/.library/device/KINDS.md")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def image_packages() -> set[str]:
    """The GPU image's package names, as KINDS.md lists them."""
    for line in KINDS.read_text().splitlines():
        if "Packages:" in line and line.startswith("nvidia-h100-x1"):
            return {norm(x.strip()) for x in line.split("Packages:", 1)[1].strip().rstrip(".").split(",")}
    raise SystemExit(f"no package list in {KINDS}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-pins", help="NAME==VERSION lines: the image's versions of packages the command needs at "
                                        "another (transformers, torch, ...); listed when the versions differ")
    p.add_argument("--out", required=True, help="the list: NAME==VERSION lines, merged with what the file holds")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    folder = tempfile.mkdtemp(prefix="dists_imported_")
    (Path(folder) / "sitecustomize.py").write_text(HOOK.format(folder=folder))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))}
    rc = subprocess.run(cmd, env=env).returncode
    modules = set()
    for f in Path(folder).glob("mods.*.txt"):
        modules |= set(f.read_text().split())
    owners = md.packages_distributions()
    dists = {norm(d) for m in modules for d in owners.get(m, [])}
    pins = {}
    if args.image_pins:
        for line in Path(args.image_pins).read_text().split():
            name, version = line.split("==")
            pins[norm(name)] = version
    held = image_packages()
    out = Path(args.out)
    lines = set(out.read_text().split()) if out.exists() else set()
    for name in sorted(dists):
        version = md.version(name)
        if not (name in held and pins.get(name, version) == version):
            lines.add(f"{name}=={version}")
    out.write_text("\n".join(sorted(lines)) + "\n")
    print(f"({len(modules)} modules from {len(list(Path(folder).glob('mods.*.txt')))} processes; exit {rc})",
          file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
