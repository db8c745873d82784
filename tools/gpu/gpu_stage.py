"""Move files larger than one device call's 64 MiB to the device machine, part by part, with checksums.

Here (before the calls):
    python tools/gpu/gpu_stage.py split FILE [FILE ...] --dir .gpu/stage --part-mb 50
writes FILE's parts (``NAME.part00``, ...) and a manifest ``NAME.json`` (the whole file's and every part's
sha256) into the git-ignored folder ``.gpu/stage``. Each device call carries one part (and the manifests) and
starts with
    python3 tools/gpu/gpu_stage.py put .gpu/stage/NAME.partKK --to /tmp/stage
which checks the part against the manifest and moves it to /tmp/stage, where it stays while the machine is
warm (about 30 s after a call: make the calls back to back). The call that needs the file runs
    python3 tools/gpu/gpu_stage.py join NAME --to /tmp/stage
which checks that every part is there, joins them, verifies the whole file's sha256, and prints its path
(exit status 3 and the missing parts otherwise: the machine went cold, start the staging again).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(paths: list[str], out_dir: str, part_mb: float) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    size = int(part_mb * (1 << 20))
    made = []
    for path in paths:
        name = os.path.basename(path)
        parts = []
        with open(path, "rb") as f:
            k = 0
            while True:
                block = f.read(size)
                if not block:
                    break
                part = os.path.join(out_dir, f"{name}.part{k:02d}")
                with open(part, "wb") as g:
                    g.write(block)
                parts.append({"file": os.path.basename(part), "sha256": hashlib.sha256(block).hexdigest(),
                              "bytes": len(block)})
                made.append(part)
                k += 1
        manifest = {"name": name, "sha256": _sha(path), "bytes": os.path.getsize(path), "parts": parts}
        with open(os.path.join(out_dir, f"{name}.json"), "w") as g:
            json.dump(manifest, g, indent=1)
        print(f"{name}: {len(parts)} parts of <= {part_mb:g} MiB in {out_dir}")
    return made


def _manifest(stage_dir: str, name: str) -> dict:
    with open(os.path.join(stage_dir, f"{name}.json")) as f:
        return json.load(f)


def put(part: str, to: str) -> None:
    """Check one part against its manifest (beside it) and move it to ``to``."""
    folder, base = os.path.split(part)
    name = base.rsplit(".part", 1)[0]
    m = _manifest(folder, name)
    want = next(p for p in m["parts"] if p["file"] == base)
    if _sha(part) != want["sha256"]:
        sys.exit(f"{part}: checksum mismatch (transfer broken?)")
    os.makedirs(to, exist_ok=True)
    shutil.copyfile(part, os.path.join(to, base))
    shutil.copyfile(os.path.join(folder, f"{name}.json"), os.path.join(to, f"{name}.json"))
    have = [p["file"] for p in m["parts"] if os.path.exists(os.path.join(to, p["file"]))]
    print(f"{base}: ok ({len(have)} of {len(m['parts'])} parts of {name} in {to})")


def join(name: str, to: str) -> str:
    m = _manifest(to, name)
    missing = [p["file"] for p in m["parts"] if not os.path.exists(os.path.join(to, p["file"]))]
    if missing:
        print(f"{name}: missing parts {missing} (the machine went cold? stage again)")
        sys.exit(3)
    out = os.path.join(to, name)
    if not (os.path.exists(out) and os.path.getsize(out) == m["bytes"] and _sha(out) == m["sha256"]):
        with open(out, "wb") as f:
            for p in m["parts"]:
                with open(os.path.join(to, p["file"]), "rb") as g:
                    shutil.copyfileobj(g, f)
        if _sha(out) != m["sha256"]:
            os.remove(out)
            sys.exit(f"{name}: the joined file's checksum does not match")
    print(out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("files", nargs="+")
    s.add_argument("--dir", default=".gpu/stage")
    s.add_argument("--part-mb", type=float, default=50)
    p = sub.add_parser("put")
    p.add_argument("part")
    p.add_argument("--to", default="/tmp/stage")
    j = sub.add_parser("join")
    j.add_argument("name")
    j.add_argument("--to", default="/tmp/stage")
    args = ap.parse_args(argv)
    if args.cmd == "split":
        split(args.files, args.dir, args.part_mb)
    elif args.cmd == "put":
        put(args.part, args.to)
    else:
        join(args.name, args.to)


if __name__ == "__main__":
    main()
