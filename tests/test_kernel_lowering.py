"""Every kernel of the op compiles for GPU targets, checked on the CPU with the installed Triton's compiler.

The interpreter (every other kernel test) runs the kernels as Python and never compiles a branch it does not take:
a TMA loop left where pointer inputs reach it passed every interpreter test and failed to compile on an H100
('tensor' object has no attribute 'load'). Here each kernel launch of the op's paths, recorded under the interpreter
with the GPU's tiles, is compiled to a cubin for sm90 with TMA loads and for sm80 (pointer loads: A100, L4, RTX),
through Triton's public ``warmup`` (``tests/scripts/lower_kernels.py``; ``tools/triton_matrix.py`` runs it for
each torch's Triton). The fp16 kernel is also compiled to PTX for sm75 and sm80: the first has no tensor-core
MMA, which is why Turing and Volta train through the torch computation (``config.KernelConfig.mma_dot``). And
each GPU generation's pointer tiles (``config.pointer_tiles``), compiled for it, must fit its shared memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "lower_kernels.py"

TARGETS = "sm90-tma,sm80"  # CI's share of the script's targets (tools/triton_matrix.py compiles every one)


@pytest.fixture(scope="module")
def lowered():
    """The script's JSON lines (one run for the module's tests)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--targets", TARGETS], env=env, capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_launch_compiles_for_sm90_tma_and_sm80(lowered):
    """Each kernel launch of the op's paths (recorded under the interpreter with the GPU's tiles) compiles to a cubin
    for Hopper with TMA loads and for an A100's pointer loads; every kernel of hf_lsce.ops is among them."""
    kernels = set(lowered[0]["kernels"])
    assert len(kernels) >= 10, kernels
    problems = [row for row in lowered if "interpreter_error" in row or "record_failed" in row]
    assert not problems, problems[:3]
    rows = [row for row in lowered if "kernel" in row]
    failed = [row for row in rows if row["result"] != "ok"]
    assert not failed, failed[:3]
    by_target = {t: {row["kernel"] for row in rows if row["target"] == t} for t in TARGETS.split(",")}
    assert by_target["sm80"] == by_target["sm90-tma"] == kernels, kernels - by_target["sm80"]
    for flag in ("TMA", "GRAD", "ONLINE", "SOFTCAP", "FIXUP"):  # the logits kernel's every mode, with TMA loads too
        assert any(row["kernel"] == "_exp_tiles_kernel" and row["flags"][flag] and row["flags"]["TMA"] for row in rows
                   if row["target"] == "sm90-tma"), flag


def test_turing_takes_cublas_because_tritons_fp16_dot_is_not_mma_there(lowered):
    """Turing and Volta take the torch computation (config.KernelConfig.mma_dot) because Triton's dots are FMA there: if
    a Triton emits tensor-core MMA for sm75, this fails and the rule is to be measured again."""
    ptx = {row["ptx_arch"]: row for row in lowered if "ptx_arch" in row}
    assert ptx[80]["result"] == "ok" and ptx[75]["result"] == "ok", ptx
    assert ptx[80]["mma"] and not ptx[75]["mma"], ptx


def test_each_gpus_pointer_tiles_fit_its_shared_memory(lowered):
    """The fused kernel's pointer-load tiles that each GPU generation takes (``config.pointer_tiles``), compiled for
    that GPU as a launch specialises them, take no more shared memory per block than the card has: else the kernel
    would not launch there (no such card is lent). The old rule gave an A100 2 stages and the 99 KiB cards 128 x 128
    tiles: 1.01-1.15 and 1.21-1.47 x the time of the 3-stage 128 x 256 tiles that fit both (Triton's sm80 code on an
    H100, docs/benchmarks.md, settled experiments: sm80_configs.py)."""
    cards = [row for row in lowered if "card" in row]
    assert len(cards) == 10
    assert all(row["result"] == "ok" for row in cards), cards
    assert all(row["shared"] <= row["smem"] for row in cards), cards
    # the A100 and the 99 KiB cards take the tiles measured on the H100's pointer loads: 128 x 256 x 64, 3 stages
    assert all(row["tiles"] == [128, 256, 64, 3] for row in cards), cards


# The integer arguments that change from batch to batch (row counts, the sequence length, split and block counts, a
# chunk's first column, a number of items): Triton would compile a kernel again for each new divisibility by 16 of
# one (and for a value of 1), inside a training step. (The logits kernel's V and v_store stay specialised on purpose:
# fused_pass says why; a chunk's width is a multiple of the tile or the vocabulary's own.)
PER_BATCH = {"n", "N", "seq", "splits", "NUM_SPLITS", "blocks", "blocks_x", "col0", "items_value"}


def test_no_kernel_specialises_on_an_argument_that_changes_with_the_batch():
    """Every launched kernel of hf_lsce.ops (``*_kernel``) lists each per-batch integer argument it takes in
    ``do_not_specialize``, so one compiled kernel serves every batch length."""
    import importlib
    import pkgutil

    import hf_lsce.ops as ops

    checked, missing = [], []
    for info in pkgutil.iter_modules(ops.__path__):
        module = importlib.import_module(f"hf_lsce.ops.{info.name}")
        for name, fn in vars(module).items():
            if not (name.endswith("_kernel") and hasattr(fn, "arg_names")):
                continue
            # (the interpreter keeps the decorator's arguments in .kwargs, or before Triton 3.4 in .rewriter.kwargs;
            # Triton's JIT as names or positions)
            given = getattr(fn, "kwargs", None) or getattr(getattr(fn, "rewriter", None), "kwargs", None) or {}
            kept = given.get("do_not_specialize") or getattr(fn, "do_not_specialize", ()) or ()
            kept = {fn.arg_names[a] if isinstance(a, int) else a for a in kept}
            checked.append(name)
            missing += [f"{info.name}.{name}: {a}" for a in fn.arg_names if a in PER_BATCH and a not in kept]
    assert len(checked) >= 10, checked
    assert not missing, missing
