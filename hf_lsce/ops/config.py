"""Block sizes of the Triton kernels, chosen per dtype and device."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import torch

# The oldest torch and Triton the package is tested with (tools/triton_matrix.py, docs/limitations.md#versions).
# TORCH_MIN: torch 2.4 cannot register the op's custom operators, transformers 5 disables torch below 2.6, and torch 2.5
# is refused with them; torch 2.6 runs the torch path and the patch exactly (its Triton 3.2 is below TRITON_MIN).
# TRITON_MIN: the oldest Triton (torch 2.7's 3.3) under which every kernel launch compiles for sm75, sm80 and sm90
# and every interpreter test of the op passes; Triton 3.2's interpreter aborts mid-suite and returned a wrong argmax in
# the low-memory pointer path, 3.1's computes the kernels wrongly. Below it the op runs its chunked torch path, with
# one warning. setup.cfg asks for torch >= 2.7 and Triton >= 3.3: the oldest row that passes everything.
TORCH_MIN = (2, 6)
TRITON_MIN = (3, 3)


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.6.0+cu124`` or ``3.3.1``."""
    major, minor = (re.match(r"(\d+)\.(\d+)", version) or re.match(r"(\d+)()", version + ".0")).groups()
    return int(major), int(minor or 0)


def torch_problem(version: str | None = None) -> str | None:
    """One line saying why this torch (``version``: the installed one) cannot run hf_lsce, or None."""
    version = version or torch.__version__
    if _release(version) >= TORCH_MIN:
        return None
    need = ".".join(map(str, TORCH_MIN))
    return (f"hf_lsce needs torch >= {need} (the oldest it is tested on), found {version}: pip install -U "
            f"'torch>={need}'")


def triton_version() -> str | None:
    """The installed Triton's version, or None where it cannot be imported."""
    try:
        import triton
    except Exception:  # noqa: BLE001 - not installed (macOS, Windows), or broken: the op takes the torch path
        return None
    return triton.__version__


@functools.lru_cache(maxsize=None)
@torch.compiler.assume_constant_result  # (torch.compile calls it while tracing: torch 2.6's cannot trace `re`)
def triton_problem() -> str | None:
    """One line saying why the op's Triton kernels cannot run here (no Triton, or one below ``TRITON_MIN``), or None.
    Cached: asked by every call of the op with ``backend="auto"``."""
    version = triton_version()
    need = ".".join(map(str, TRITON_MIN))
    if version is None:
        return f"Triton is not importable here; the fused kernels need triton >= {need} (Linux, with torch)"
    if _release(version) < TRITON_MIN:
        return (f"Triton {version} is older than the {need} the fused kernels are tested with: pip install -U "
                f"'triton>={need}' (or a torch that brings it)")
    return None


@dataclass(frozen=True)
class KernelConfig:
    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int
    dot_precision: str
    min_programs: int  # the grid's vocabulary splits: about this many programs, at least min_splits (L2 reuse)
    upcast_dot: bool = False  # fp32 operands for tl.dot: the interpreter's bf16 dot is wrong
    min_splits: int = 1
    tma: bool = False  # TMA loads (Hopper and data-centre Blackwell, half precision): tiles.tma_ready
    # Triton's tl.dot is tensor-core MMA (compute capability 8.0 and newer, the interpreter): the fused computation's
    # condition; below it (Turing, Volta) the fp16 kernel's PTX has no mma instruction, and the torch computation runs
    mma_dot: bool = True


# HF_LSCE_TMA=0: the kernels take pointer loads where they would take TMA ones (a Hopper GPU then runs what an A100,
# an L4 or an RTX card runs, so that path is measured and tested here); 1 or unset: TMA where the GPU has it.
TMA_SWITCH = os.environ.get("HF_LSCE_TMA", "")
if TMA_SWITCH not in ("", "0", "1"):
    raise ValueError(f"HF_LSCE_TMA must be 0 (pointer loads everywhere) or 1 (TMA where the GPU has it; the default), "
                     f"got {TMA_SWITCH!r}.")


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fused_config(dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """The logits kernel's configuration for this dtype and device (cached: asked several times by every call)."""
    return _fused_config(dtype, torch.device(device), interpreting())


@functools.lru_cache(maxsize=None)
def _fused_config(dtype: torch.dtype, device: torch.device, interp: bool) -> KernelConfig:
    prec = "ieee" if dtype == torch.float32 else "tf32"
    if interp:
        return KernelConfig(16, 32, 16, 1, 1, prec, 6, upcast_dot=dtype == torch.bfloat16)
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    mma_dot = compiled_capability(props)[0] >= 8  # (see KernelConfig.mma_dot)
    if dtype == torch.float32:  # (fp32 takes the torch computation; the config says where dots are MMA)
        return KernelConfig(64, 64, 32, 4, 3, prec, 2 * sms, mma_dot=mma_dot)
    if torch.version.cuda is not None and tma_capable(props) and _has_tensor_descriptors() and TMA_SWITCH != "0":
        # TMA: 128 x 256 x 64 tiles, 8 warps, 3 stages, about two waves of programs, at least 2 vocabulary splits: the
        # fastest measured (docs/benchmarks.md, settled experiments: forward_variants.py)
        return KernelConfig(128, 256, 64, 8, 3, prec, 2 * sms, min_splits=2, tma=True)
    # Pointer loads: the same tiles in a D loop per vocabulary tile where the shared memory holds them (pointer_tiles;
    # settled experiments: pointer_blocks.py, sm80_configs.py)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 0
    bn, bv, bd, stages = pointer_tiles(smem)
    return KernelConfig(bn, bv, bd, 8, stages, prec, 2 * sms, min_splits=2, mma_dot=mma_dot)


def pointer_tiles(smem: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_V, BLOCK_D, stages) of the pointer loads for a GPU whose blocks may take ``smem`` bytes of
    shared memory (0: unknown): 128 x 256 x 64 in 3 stages where they fit, else fewer stages or 128 columns. Triton
    pipelines ``stages - 1`` buffers of ``(BLOCK_N + BLOCK_V) BLOCK_D`` 2-byte elements (48 / 96 / 144 KiB at 2 / 3 / 4
    stages); ``tests/test_kernel_lowering.py`` checks each GPU's choice against its limit."""
    for bv in (256, 128):
        stages = min(3, 1 + smem // ((128 + bv) * 64 * 2)) if smem else 3
        if stages >= 2:
            return 128, bv, 64, stages
    return 128, 128, 64, 2


def clear_caches() -> None:
    """Forget the cached configurations (after ``TMA_SWITCH`` changed: the benchmarks run both loads side by side)."""
    _fused_config.cache_clear()


@functools.lru_cache(maxsize=None)
def device_memory(device: torch.device) -> int:
    """The CUDA device's total memory in bytes (cached: asked on every training call with memory="auto")."""
    return torch.cuda.get_device_properties(device).total_memory


def free_cuda_memory(device) -> int:
    """Bytes new buffers can take on a CUDA device: the driver's free memory plus what torch's caching allocator holds
    unused. One nested-dict read of the allocator's counters (0.13 ms of host time, where ``memory_reserved`` and
    ``memory_allocated`` took 1.0 ms together: each flattens every statistic)."""
    free, _ = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:  # the allocator has not been initialised: nothing reserved
        return free
    return free + stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"]


TMA_SMEM_BYTES = 200 * 1024  # the TMA kernel's shared memory per block: 3 stages of 128 x 64 + 256 x 64, and scratch


def tma_capable(props) -> bool:
    """Whether a GPU (``torch.cuda.get_device_properties``) runs the TMA kernel: compute capability 9.0 or newer and
    room for its shared memory (consumer Blackwell, about 100 KiB a block, has not; without the property, older
    torch, Hopper and data-centre Blackwell are assumed to have it)."""
    major = compiled_capability(props)[0]
    if major < 9:
        return False
    smem = getattr(props, "shared_memory_per_block_optin", None)
    return smem >= TMA_SMEM_BYTES if smem else major in (9, 10)


def compiled_capability(props) -> tuple[int, int]:
    """The compute capability Triton compiles for: ``TRITON_OVERRIDE_ARCH``'s (``sm80``: a Hopper GPU then runs an
    A100's code and the op takes its paths), else the GPU's own."""
    arch = re.fullmatch(r"sm(\d+)", os.environ.get("TRITON_OVERRIDE_ARCH", ""))
    if arch:
        return int(arch.group(1)) // 10, int(arch.group(1)) % 10
    return props.major, getattr(props, "minor", 0)


@functools.lru_cache(maxsize=None)
def _has_tensor_descriptors() -> bool:
    """Host-side tensor descriptors as the TMA kernel uses them: Triton 3.4 and later (cached)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return _release(triton_version()) >= (3, 4)
