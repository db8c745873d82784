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
    # of h and W: tiles.vocab_splits, fused_pass.fused_splits).
    min_programs: int
    # fp32 operands for tl.dot: only under the interpreter, whose bf16 dot is wrong.
    upcast_dot: bool = False
    # Let triton.autotune pick the block sizes (CUDA; kernels without side effects only).
    autotune: bool = False
    min_splits: int = 1
    # TMA loads (Hopper and data-centre Blackwell, half precision): tiles.tma_ready.
    tma: bool = False
    # Triton's tl.dot lowers to tensor-core MMA (compute capability 8.0 and newer, and the interpreter): the fused
    # path's condition, and on CUDA the two-pass path's (its G kernel's dots). Below it Triton 3.9 lowers fp16 dots to
    # FMA: the fp16 kernel compiled for sm75 and sm70 has no mma instruction, for sm80 m16n8k16 (tl.dot's PTX, compiled
    # on the CPU); Turing and Volta take cuBLAS's tensor cores through the one-pass path instead.
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
    training and the statistics alone) and, with TMA, the G kernels' (``grad_logits_config``). Cached: asked several
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


def grad_logits_config(dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """The kernels writing G = dL/dz (``backward._lce_grad_logits*``): the fused logits kernel's TMA loop and grid
    where it has one (its logits, another epilogue), else the pointer kernel (autotuned in half precision)."""
    config = fused_config(dtype, device)
    if config.tma:
        return config
    prec = "ieee" if dtype == torch.float32 else "tf32"
    if interpreting():
        return KernelConfig(16, 32, 16, 1, 1, prec, 1, upcast_dot=dtype == torch.bfloat16)
    if dtype == torch.float32:
        return KernelConfig(64, 64, 32, 4, 3, prec, 1)
    return KernelConfig(128, 128, 64, 8, 3, prec, 1, autotune=True)


# The training path by hidden size: up to this D the fused path (bf16 with the TMA kernel; fused_pass.py) or else the
# two-pass path (the fused kernel's statistics for the lse, then the logits
# recomputed on chip and G written in the input dtype, dh and dW from cuBLAS), above it the one-pass path (fp32
# logits from cuBLAS, read twice). The one-pass path saves a logits matmul (2 N D V FLOPs) but moves about 14 N V
# bytes more; the crossing sits near D = 12 * (tensor FLOP/s) / (2 * HBM bytes/s), about 1,400 on an H100.
# Measured: see docs/how_it_works.md ("Two training paths").
TWO_PASS_MAX_D = 1024
# memory="auto": a path's buffers are taken to fit when CUDA's free memory holds this multiple of them
MEMORY_HEADROOM = 1.25
# Force one training path where it can run: "fused", "one-pass" or "two-pass" (tests run each under the interpreter;
# benchmarks compare them). Unset: the fused path where it runs (linear_cross_entropy._train_path), else by
# TWO_PASS_MAX_D on CUDA, the one-pass path elsewhere.
TRAIN_PATH = os.environ.get("HF_LSCE_TRAIN_PATH") or None
if TRAIN_PATH not in (None, "fused", "one-pass", "two-pass"):
    raise ValueError(f"HF_LSCE_TRAIN_PATH must be 'fused', 'one-pass' or 'two-pass' (or unset), got {TRAIN_PATH!r}.")

# Memory for one chunk of G (the logits' gradient) in the two-pass path and the recomputing backward (backward.py).
GRAD_CHUNK_BYTES = 1 << 30
# Memory for one chunk of fp32 logits of the one-pass training path (train_pass.py). Larger chunks
# mean fewer passes over dW (read and written once per chunk): measured on an H100 at the Gemma2-2B
# shape, fwd+bwd took 62.4 / 53.6 / 49.9 / 50.5 ms with 0.5 / 1 / 2 / 4 GiB chunks.
TRAIN_CHUNK_BYTES = 2 << 30
# Memory for one chunk of fp32 logits where the per-token statistics alone (evaluation) come from cuBLAS
# (dispatch.cublas_logits). Measured on an H100 (N = 8,192, evaluation): fp32 Gemma-3-270m 68.1 / 60.6 / 57.3 ms with
# 256 MiB / 1 GiB / 2 GiB chunks, Llama-3-8B 187.7 / 171.4 / 172.8; bf16 (forced) 10.9 / 9.0 / 9.1 and
# 15.3 / 13.7 / 14.1 (docs/benchmarks.md, settled experiments: stats_chunk.py).
STATS_CHUNK_BYTES = 1 << 30


def stats_chunk_bytes(free_bytes: int | None) -> int:
    """Bytes of the cuBLAS statistics route's chunk of fp32 logits (``dispatch.forward_stats``): ``STATS_CHUNK_BYTES``,
    or what CUDA's free memory ``free_bytes`` holds with ``MEMORY_HEADROOM``, at least ``LOW_MEMORY_CHUNK_BYTES`` (an
    evaluation call on a nearly full GPU, where the fused kernel's statistics would need no buffer)."""
    if free_bytes is None:
        return STATS_CHUNK_BYTES
    return max(LOW_MEMORY_CHUNK_BYTES, min(STATS_CHUNK_BYTES, int(free_bytes / MEMORY_HEADROOM)))


# The low-memory mode (memory="low"): its extra memory is the fp32 dh accumulator (4 N D bytes) and one chunk of G (the
# input dtype) over vocabulary columns, which takes what LOW_MEMORY_BYTES leaves beside the accumulator, and at least
# LOW_MEMORY_CHUNK_BYTES. Small chunks are many launches: at N = 8192 (H100, Gemma-3-270m head, trainable) 32 MiB chunks
# took 42.4 ms, host-bound (128 chunks; 20.7 ms of kernels), 64 MiB 19.7 ms and 128 MiB 18.7 ms (docs/benchmarks.md).
LOW_MEMORY_BYTES = 180 << 20
LOW_MEMORY_CHUNK_BYTES = 32 << 20


def low_memory_chunk_bytes(n: int, d: int, free_bytes: int | None = None) -> int:
    """Bytes of G's vocabulary chunk in the low-memory mode for N rows of hidden size D; ``free_bytes`` (CUDA's free
    memory, where memory="auto" chose this mode because it was short) lowers the budget to what it holds."""
    budget = LOW_MEMORY_BYTES if free_bytes is None else min(LOW_MEMORY_BYTES, int(free_bytes / MEMORY_HEADROOM))
    return max(LOW_MEMORY_CHUNK_BYTES, budget - 4 * n * d)


def tuning_configs(shapes) -> list:
    """triton.autotune candidates from (BLOCK_N, BLOCK_V, BLOCK_D, num_warps, num_stages) tuples."""
    import triton

    return [triton.Config(dict(BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd), num_warps=w, num_stages=st)
            for bn, bv, bd, w, st in shapes]


def launch(kernel, tuned, config: KernelConfig, grid, args, flags) -> None:
    """Run ``kernel`` with ``config``'s block sizes, or its autotuned twin ``tuned`` when the config asks
    for autotuning and one exists (kernels with side effects, such as atomics, have none).
    ``grid(meta)`` maps the block sizes to the launch grid."""
    if config.autotune and tuned is not None:
        tuned[grid](*args, **flags)
        return
    meta = dict(BLOCK_N=config.block_n, BLOCK_V=config.block_v, BLOCK_D=config.block_d)
    kernel[grid(meta)](*args, **flags, **meta, num_warps=config.num_warps, num_stages=config.num_stages)
