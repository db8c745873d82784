"""The op's kernels on each torch release a user may have, with the Triton that release brings, on the CPU.

    python tools/triton_matrix.py [--root /tmp/tv] [--torch 2.4.1,2.6.0,...] [--skip-install] [--out results.json]

For each torch (default: one release per minor from 2.4 to the newest on the registry) a virtual environment of its
own holds that torch, the Triton its wheel pins (PyPI's CUDA build: it runs on the CPU), and hf_lsce with --no-deps
plus what the op's tests import. Then, in that environment:

1. ``tests/scripts/lower_kernels.py``: every kernel launch of the op's paths (recorded once, by the Triton of the
   environment running this script), compiled by that Triton for sm90 with TMA, sm80 (pointer loads, as every GPU
   without TMA) and sm75 (Turing's route), and the logits kernel's pointer tiles for each GPU generation: how many
   compiled, and the first errors;
2. the op's interpreter tests (``TRITON_INTERPRET=1``): tests/test_ops.py, test_fused_pass.py, test_paths.py and
   test_compile.py, where that Triton's interpreter can run them: passed / failed, and the first failure's last line;
3. the op's torch path (``backend="torch"``) against fp64 with the patch on a tiny Llama: ok or the error.

Prints a markdown table (docs/limitations.md keeps it, with this command) and writes the rows as JSON. setup.cfg's
``torch`` and ``triton`` floors, and ``hf_lsce.ops.config.TRITON_MIN``, are the oldest rows that pass. Making the
environments downloads about 3 GB per torch (uv's cache shares what releases have in common).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH = ["2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1",
         "2.15.0"]
# what the op's tests import beyond torch and Triton (hf_lsce itself goes in with --no-deps; Triton before 3.4 imports
# setuptools)
DEPS = ["setuptools", "pytest", "pytest-xdist", "accelerate", "tqdm", "gguf", "matplotlib"]


def deps(torch_version: str) -> list[str]:
    """``DEPS`` and the numpy and transformers of that torch's time: Triton's interpreter before 3.7 (torch < 2.12)
    converts 1-element arrays to scalars, which numpy 2.4 refuses ('only 0-dimensional arrays can be converted');
    transformers 5 disables torch older than 2.6, so torch 2.5 gets 4.57.1 (setup.cfg's floor)."""
    release = tuple(int(x) for x in torch_version.split(".")[:2])
    numpy = "numpy<2.4" if release < (2, 12) else "numpy"
    transformers = "transformers==4.57.1" if release < (2, 6) else "transformers>=4.57.1"
    return [*DEPS, numpy, transformers]
# sm90 with TMA, an A100's pointer loads and Turing's route (each GPU generation's pointer tiles for the logits kernel
# are compiled for every card beside them)
TARGETS = "sm90-tma,sm80,sm75"
INTERPRETER_TESTS = ["tests/test_ops.py", "tests/test_fused_pass.py", "tests/test_paths.py", "tests/test_compile.py"]
TORCH_PATH_CHECK = r"""
import torch, torch.nn.functional as F
from hf_lsce import linear_cross_entropy, apply_lsce_patch
g = torch.Generator().manual_seed(0)
h, w = torch.randn(300, 64, generator=g, dtype=torch.float64), torch.randn(1000, 64, generator=g, dtype=torch.float64)
y = torch.randint(0, 1000, (300,), generator=g); y[::5] = -100
for dt in (torch.float32, torch.bfloat16):
    got = linear_cross_entropy(h.to(dt), w.to(dt), y, label_smoothing=0.1, backend="torch")
    ref = F.cross_entropy((h.to(dt).double() @ w.to(dt).double().T), y, label_smoothing=0.1)
    assert abs(float(got) - float(ref)) < 1e-5 * float(ref), (dt, float(got), float(ref))
from transformers import LlamaConfig, LlamaForCausalLM
m = LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2))
ids = torch.randint(0, 500, (2, 12), generator=g)
logits = m(ids).logits
ref = F.cross_entropy(logits[:, :-1].reshape(-1, 500).float(), ids[:, 1:].reshape(-1), label_smoothing=0.1)
apply_lsce_patch(m, label_smoothing=0.1)
out = m(ids, labels=ids)
assert abs(float(out.loss) - float(ref)) < 1e-5, (float(out.loss), float(ref))
print("torch path ok")
"""


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, **kw)


def install(env: Path, torch_version: str, python: str) -> str | None:
    """The environment for one torch; None, or why it could not be made."""
    uv = ["uv", "--quiet"]
    r = sh([*uv, "venv", "--allow-existing", "-p", python, env])
    if r.returncode == 0:
        r = sh([*uv, "pip", "install", "-p", env / "bin" / "python", f"torch=={torch_version}", *deps(torch_version)])
    if r.returncode == 0:
        r = sh([*uv, "pip", "install", "-p", env / "bin" / "python", "--no-deps", "-e", ROOT])
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1][:300]


def versions(py: Path) -> dict:
    r = sh([py, "-c", "import json, torch, triton, transformers; print(json.dumps(dict(torch=torch.__version__, "
                      "triton=triton.__version__, transformers=transformers.__version__)))"])
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else dict(error=r.stderr[-300:])


def lowering(py: Path, launches: str) -> dict:
    """Compiled / total per target (the launches recorded once, ``launches``), and the distinct errors (a few)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = sh([py, "tests/scripts/lower_kernels.py", "--launches", launches], env=env, timeout=3600)
    Path(launches).with_name(f"lowered_{py.parents[1].name}.jsonl").write_text(r.stdout)  # (the raw lines, kept)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not rows:
        return dict(error=(r.stderr.strip().splitlines() or ["no output"])[-1][:300])
    out: dict = dict(targets={}, errors=[], kernels=len(rows[0].get("kernels", [])))
    for row in rows[1:]:
        key = row.get("target") or row.get("job") or (f"ptx sm{row['ptx_arch']}" if "ptx_arch" in row else
                                                      f"card {row.get('card')}")
        if key.startswith("card:"):
            key = f"card {key[5:]}"
        t = out["targets"].setdefault(key, dict(ok=0, failed=0))
        if "skipped" in row:
            t["skipped"] = row["skipped"]
            continue
        result = row.get("result") or row.get("interpreter_error") or row.get("record_failed") or (
            f"crashed: {row['crashed']}" if "crashed" in row else "?")
        if result == "ok":
            t["ok"] += 1
        else:
            t["failed"] += 1
            msg = f"{key} {row.get('kernel', '')}: {result}"
            if len(out["errors"]) < 8 and not any(msg.split(": ", 1)[1] == e.split(": ", 1)[1] for e in out["errors"]):
                out["errors"].append(msg[:300])
        if "mma" in row:
            t["mma"] = row["mma"]
    return out


def interpreter_tests(py: Path) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    t0 = time.time()
    r = sh([py, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "--maxfail=20", "--tb=line",
            *INTERPRETER_TESTS],
           env=env, timeout=3600)
    tail = r.stdout.strip().splitlines()
    summary = tail[-1] if tail else r.stderr[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    first = next((line for line in tail if line.startswith(("E ", "/")) or "Error" in line), "")
    return dict(counts, summary=summary[:200], first_failure=first[:300] if r.returncode else "",
                minutes=round((time.time() - t0) / 60, 1))


def torch_path(py: Path) -> str:
    r = sh([py, "-c", TORCH_PATH_CHECK], env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    return "ok" if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1][:300]


def table(rows: list[dict]) -> str:
    lines = ["| torch | Triton | kernel launches compiled: sm90 TMA / sm80 / sm75 | the logits kernel's pointer "
             "tiles for each GPU (A100, A10, L4, RTX 50, H100) | interpreter tests | torch path + patch |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        v = row.get("versions", {})
        low = row.get("lowering", {})
        targets = low.get("targets", {})
        cells = []
        for target in TARGETS.split(","):
            t = targets.get(target)
            cells.append("-" if t is None else "n/a" if "skipped" in t else f"{t['ok']}/{t['ok'] + t['failed']}")
        lowered = " / ".join(cells) if "targets" in low else low.get("error", row.get("install_error", ""))
        cards = [t for k, t in targets.items() if k.startswith("card ")]
        tiles = f"{sum(t['ok'] for t in cards)}/{sum(t['ok'] + t['failed'] for t in cards)}" if cards else "-"
        it = row.get("interpreter", {})
        its = (f"{it.get('passed', 0)} passed, {it.get('skipped', 0)} skipped, "
               f"{it.get('failed', 0) + it.get('error', 0)} failed"
               + (f" ({it['first_failure']})" if it.get("first_failure") else "")) if it else ""
        lines.append(f"| {v.get('torch', row['torch'])} | {v.get('triton', '')} | {lowered} | {tiles} | {its} | "
                     f"{row.get('torch_path', '')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/tv", help="where the environments are made")
    p.add_argument("--torch", default=",".join(TORCH), help="comma-separated torch releases")
    p.add_argument("--python", default="3.11", help="the environments' Python (uv finds it)")
    p.add_argument("--skip-install", action="store_true", help="reuse environments made before")
    p.add_argument("--skip-tests", action="store_true", help="only the kernels' lowering and the torch path")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "triton_matrix.json"))
    args = p.parse_args(argv)
    # the kernels' launches, recorded once with this environment's Triton (the interpreters of Triton before 3.4
    # cannot run every path), then compiled by each torch's Triton
    launches = str(Path(args.root) / "launches.json")
    r = sh([sys.executable, "tests/scripts/lower_kernels.py", "--launches", launches, "--save", "--targets", TARGETS],
           env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    if r.returncode != 0:
        print(r.stderr[-2000:])
        return 1
    # rows of an earlier run (another --torch list) are kept, this run's replace theirs
    old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else []
    rows = [r for r in old if r["torch"] not in args.torch.split(",")]
    for tv in args.torch.split(","):
        env = Path(args.root) / f"torch{tv}"
        py = env / "bin" / "python"
        row: dict = dict(torch=tv)
        problem = None if args.skip_install else install(env, tv, args.python)
        if problem:
            row["install_error"] = problem
        else:
            row["versions"] = versions(py)
            row["lowering"] = lowering(py, launches)
            row["torch_path"] = torch_path(py)
            if not args.skip_tests:
                row["interpreter"] = interpreter_tests(py)
        rows.append(row)
        rows.sort(key=lambda r: tuple(int(x) for x in r["torch"].split(".")))
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
