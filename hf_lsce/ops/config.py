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
    # Split the vocabulary until the grid has about this many programs, and into at least min_splits parts (L2 reuse
    # of h and W: fused_pass.fused_splits).
    min_programs: int
    # fp32 operands for tl.dot: only under the interpreter, whose bf16 dot is wrong.
    upcast_dot: bool = False
    # Let triton.autotune pick the block sizes (CUDA; kernels without side effects only).
    autotune: bool = False
    min_splits: int = 1
    # TMA loads (Hopper and data-centre Blackwell, half precision): tiles.tma_ready.
    tma: bool = False
    # Triton's tl.dot lowers to tensor-core MMA (compute capability 8.0 and newer, and the interpreter): the fused
    # computation's condition. Below it Triton 3.9 lowers fp16 dots to FMA: the fp16 kernel compiled for sm75 and sm70
    # has no mma instruction, for sm80 m16n8k16 (tl.dot's PTX, compiled on the CPU); Turing and Volta take the torch
    # computation (cuBLAS's tensor cores) instead.
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
    """The logits kernels' configuration for this dtype and device: the fused pass's (``fused_pass._exp_tiles_kernel``,
    training, its G epilogue and the statistics alone). Cached: asked several
    times by every call of the op."""
    return _fused_config(dtype, torch.device(device), interpreting())


@functools.lru_cache(maxsize=None)
def _fused_config(dtype: torch.dtype, device: torch.device, interp: bool) -> KernelConfig:
    prec = "ieee" if dtype == torch.float32 else "tf32"
    if interp:
        return KernelConfig(16, 32, 16, 1, 1, prec, 6, upcast_dot=dtype == torch.bfloat16)
    props = torch.cuda.get_device_properties(device)
    sms = props.multi_processor_count
    mma_dot = compiled_capability(props)[0] >= 8  # (see KernelConfig.mma_dot)
    if dtype == torch.float32:  # (no fp32 mode: fp32 takes cuBLAS's logits; the config says where dots are MMA)
        return KernelConfig(64, 64, 32, 4, 3, prec, 2 * sms, mma_dot=mma_dot)
    if torch.version.cuda is not None and tma_capable(props) and _has_tensor_descriptors() and TMA_SWITCH != "0":
        # TMA loads: 128 x 256 x 64 tiles, 8 warps, 3 stages was the fastest candidate at every shape and split count
        # measured on an H100 (256 x 128, 128 x 128 and 4 stages were slower; docs/benchmarks.md, settled experiments:
        # forward_variants.py). About two waves of programs: as few vocabulary splits as fill the GPU, so the programs
        # resident at once share each W tile through L2; 4 / 8 / 16 splits at N = 8192 took 14.5 / 15.7 / 20.1 ms
        # (Gemma2-2B shape). At least 2, or the rows of h the resident programs read no longer fit in L2: at
        # N = 32768, 1 / 2 / 4 splits took 77.2 / 60.8 / 58.8 ms.
        return KernelConfig(128, 256, 64, 8, 3, prec, 2 * sms, min_splits=2, tma=True)
    # Pointer loads: 128 x 256 x 64 tiles, 8 warps and 3 stages in a D loop per vocabulary tile, as few vocabulary
    # splits as fill the GPU (at least 2). Measured with HF_LSCE_TMA=0 on an H200 (b = 0.1, N = 8,192;
    # docs/benchmarks.md, settled experiments: pointer_blocks.py): 1.06-1.11 x the TMA kernel's op at the
    # Gemma-3-270m, Gemma2-2B and Llama-3-8B heads, the fastest of five shapes at each; 128 x 128 and 256 x 128 tiles
    # were 1-12 % slower. An A100's 164 KiB and the 99 KiB of an A10, an L4 or an RTX card hold the same tiles and
    # stages (``pointer_tiles``); those cards' own times were not measured here.
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 0
    bn, bv, bd, stages = pointer_tiles(smem)
    return KernelConfig(bn, bv, bd, 8, stages, prec, 2 * sms, min_splits=2, mma_dot=mma_dot)


def pointer_tiles(smem: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_V, BLOCK_D, stages) of the fused kernel's pointer loads for a GPU whose blocks may take
    ``smem`` bytes of shared memory (0: unknown, taken as enough): 128 x 256 x 64 tiles in 3 stages (the measured
    shape, ``fused_config``) where they fit, else fewer stages or 128-column tiles. Triton 3.9 pipelines the D loop's
    loads into ``stages - 1`` buffers of ``(BLOCK_N + BLOCK_V) BLOCK_D`` 2-byte elements, the epilogue's scratch
    within them: compiled for sm80, sm86, sm89 and sm120 the kernel takes 48 / 96 / 144 KiB at 2 / 3 / 4 stages of
    128 x 256 x 64 (on sm90, whose pointer loads only an H100 or H200 under HF_LSCE_TMA=0 takes, 144 KiB at 3 of its
    227). ``tests/test_kernel_lowering.py`` checks each GPU's choice against its limit. The rule before (48 KiB and
    8 KiB of scratch per stage) gave an A100 2 stages and the 99 KiB cards (A10, L4, RTX) 128 x 128 tiles in 2: with
    Triton's sm80 code on an H100 those took 1.01-1.15 and 1.21-1.47 x these tiles' time at the Gemma-3-270m,
    Gemma2-2B and Llama-3-8B heads (docs/benchmarks.md, settled experiments: sm80_configs.py)."""
    for bv in (256, 128):
        stages = min(3, 1 + smem // ((128 + bv) * 64 * 2)) if smem else 3
        if stages >= 2:
            return 128, bv, 64, stages
    return 128, 128, 64, 2


def clear_caches() -> None:
    """Forget the cached kernel configurations (after ``TMA_SWITCH`` changed in this process: the benchmarks run
    both kernels side by side)."""
    _fused_config.cache_clear()


@functools.lru_cache(maxsize=None)
def device_memory(device: torch.device) -> int:
    """The CUDA device's total memory in bytes (cached: asked on every training call with memory="auto")."""
    return torch.cuda.get_device_properties(device).total_memory


def free_cuda_memory(device) -> int:
    """Bytes new buffers can take on a CUDA device: the driver's free memory plus what torch's caching allocator holds
    and does not use (a training loop keeps most of its memory reserved between steps). The allocator's counters come
    from one nested-dict read: ``torch.cuda.memory_reserved``/``memory_allocated`` each flatten every statistic in
    Python (together 1.0 ms of a 6.5 ms fused call under cProfile on the H100 machine, against 0.13 ms for this read:
    benchmarks/host_overhead.py --cprofile-only --tokens 8192)."""
    free, _ = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:  # the allocator has not been initialised: nothing reserved
        return free
    return free + stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"]


# Shared memory the TMA logits kernels need per block: 3 stages of a 128 x 64 tile of h and a 256 x 64 tile
# of W in 2-byte elements (144 KiB), plus the epilogue's reduction scratch.
TMA_SMEM_BYTES = 200 * 1024


def tma_capable(props) -> bool:
    """Whether a GPU (``torch.cuda.get_device_properties``) can run the TMA logits kernels: TMA (compute
    capability 9.0 or newer) and room for its shared memory. Consumer Blackwell (sm_120, about 100 KiB
    per block) has TMA but not the room, and gets the pointer kernel. Without the shared-memory property
    (older torch), the data-centre generations (9.x Hopper, 10.x Blackwell) are assumed to have it."""
    major = compiled_capability(props)[0]
    if major < 9:
        return False
    smem = getattr(props, "shared_memory_per_block_optin", None)
    return smem >= TMA_SMEM_BYTES if smem else major in (9, 10)


def compiled_capability(props) -> tuple[int, int]:
    """The compute capability Triton compiles for: ``TRITON_OVERRIDE_ARCH``'s (``sm80``, ``sm75``: Triton lowers every
    kernel as for that GPU, then assembles it for the one present, so a Hopper GPU runs an A100's or a T4's code, and
    the op takes that GPU's paths), else the GPU's own (``props``: ``torch.cuda.get_device_properties``)."""
    arch = re.fullmatch(r"sm(\d+)", os.environ.get("TRITON_OVERRIDE_ARCH", ""))
    if arch:
        return int(arch.group(1)) // 10, int(arch.group(1)) % 10
    return props.major, getattr(props, "minor", 0)


@functools.lru_cache(maxsize=None)
def _has_tensor_descriptors() -> bool:
    """Host-side tensor descriptors as the TMA kernel uses them (``TensorDescriptor`` passed to a kernel,
    ``desc.load``): Triton 3.4 and later (measured with 3.6 on an H100; the interpreter with 3.9).
    Cached: ``fused_config`` asks on every call of the op."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return _release(triton_version()) >= (3, 4)
