"""The fused path's logits kernel compiles for a GPU target in every variant, checked on the CPU.

The interpreter (every other kernel test) runs the kernel as Python and never compiles a branch it does not take:
a TMA loop left where pointer inputs reach it passed every interpreter test and failed to compile on an H100
('tensor' object has no attribute 'load'). Here Triton's front end lowers each variant to its IR for sm80 (pointer
loads: A100, L4, RTX) and sm90 (TMA and pointers), which is where that error is raised. The fp16 kernel is also
compiled to PTX for sm75 and sm80: the first has no tensor-core MMA, which is why Turing and Volta train through the
one-pass path's cuBLAS (``config.KernelConfig.mma_dot``). And each GPU generation's pointer tiles
(``config.pointer_tiles``), compiled for it, must fit its shared memory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "lower_kernels.py"


@pytest.fixture(scope="module")
def lowered():
    """The script's JSON lines (one run for the module's tests)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if rows and "unavailable" in rows[0]:
        pytest.skip(f"Triton's compiler front end is not importable this way here: {rows[0]['unavailable']}")
    return rows


def test_fused_logits_kernel_lowers_for_every_variant_and_target(lowered):
    ptx = {row["ptx_arch"]: row for row in lowered if "ptx_arch" in row}
    rows = [row for row in lowered if "ptx_arch" not in row and "card" not in row]
    assert len(rows) == 120  # bf16: sm90 2 loads x 32 flag sets, sm80 pointers x 32; fp16 online: 16 + 8
    failed = [row for row in rows if row["result"] != "ok"]
    assert not failed, failed[:3]
    # Turing and Volta take the one-pass path (config.KernelConfig.mma_dot) because Triton's dots are FMA there: if
    # a Triton emits tensor-core MMA for sm75, this fails and the rule is to be measured again
    if all("mma" in row for row in ptx.values()):
        assert ptx[80]["mma"] and not ptx[75]["mma"], ptx


def test_each_gpus_pointer_tiles_fit_its_shared_memory(lowered):
    """The fused kernel's pointer-load tiles that each GPU generation takes (``config.pointer_tiles``), compiled for
    that GPU as a launch specialises them, take no more shared memory per block than the card has: else the kernel
    would not launch there (no such card is lent). The old rule gave an A100 2 stages and the 99 KiB cards 128 x 128
    tiles: 1.01-1.15 and 1.21-1.47 x the time of the 3-stage 128 x 256 tiles that fit both (Triton's sm80 code on an
    H100, docs/benchmarks.md, settled experiments: sm80_configs.py)."""
    cards = [row for row in lowered if "card" in row]
    if not cards or any("unavailable" in row for row in cards):
        pytest.skip(f"no PTX back end here: {cards[:1]}")
    assert len(cards) == 10
    assert all(row["shared"] <= row["smem"] for row in cards), cards
    # the A100 and the 99 KiB cards take the tiles measured on the H100's pointer loads: 128 x 256 x 64, 3 stages
    assert all(row["tiles"] == [128, 256, 64, 3] for row in cards), cards
