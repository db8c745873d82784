"""The memory budget: what each way of computing the op holds beyond its inputs and the gradients it returns, and the
fastest one within a budget. A plan is a computation and a layout: ``fused`` ``rows`` (R for ``rows`` rows at a
time; fewer than all add dW's fp32 accumulator), ``fused`` ``columns`` (R kept for ``keep`` columns, the rest
recomputed ``cols`` at a time as G, dh in an fp32 accumulator: the small budgets), ``fused`` ``frozen`` (no dW: chunks
of ``cols`` columns, the logits once), ``torch`` (chunks of ``rows`` rows of fp32 logits).

The byte models count every buffer the code allocates, so a measured peak stays within its budget plus
``SLACK_BYTES`` (benchmarks/check_gpu.py's budget section). The cost model ranks plans in logits matmuls: it picks,
it does not promise (docs/how_it_works.md has the measured times).

Where ``memory`` is decided: ``options`` gives a call its computation (the fused one where ``fused_pass.supported``,
else the torch one) and, for a training call or the torch computation, the fastest plan within the budget
(``plan_for``): ``"auto"`` (CUDA's free memory over ``HEADROOM``, at most ``AUTO_MAX_BYTES``; read only where the
fastest plan exceeds ``SMALL_BUFFER_FRACTION`` of the device, the query costing host time), ``"low"`` or bytes; one
no plan fits, or the device cannot hold, is a ``ValueError`` before any kernel runs. ``linear_cross_entropy`` asks
once per call and hands the ``Options`` down (``paths.py`` runs them); under ``torch.compile`` the operators ask when
the graph runs, where the rows (symbolic while tracing) and the free memory of that step are known.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

# memory="low": at most this much, or the smallest plan with chunks of at least MIN_CHUNK_BYTES where that is more.
LOW_BYTES = 180 << 20
MIN_CHUNK_BYTES = 32 << 20
# memory="auto": the budget is CUDA's free memory divided by this, and at most AUTO_MAX_BYTES. Without that cap, auto
# kept R for every row of a large step (32 GB at 15 x 4,096 tokens of Gemma-3-270m), which left too little for the
# optimizer's next step: the Trainer's largest three-step batch was 15-18 sequences, 26 with the cap (H200,
# docs/benchmarks.md)
HEADROOM = 1.25
AUTO_MAX_BYTES = 4_500_000_000
# what a measured peak may exceed a plan's bytes by (allocations rounded to 512 bytes, 2 MiB segments)
SLACK_BYTES = 1 << 20
# The cost model: tensor-core rate over memory bandwidth (bf16 dense FLOP per byte: H100 295, H200 206, A100 156), the
# rate (FLOP/s), and what one more chunk costs beyond its share of the work (about 0.1 ms: 1,024 chunks of 256 columns
# took 132 ms where 10 took 17.6, Gemma-3-270m head, N = 8,192, H200; docs/benchmarks.md).
FLOP_PER_BYTE = 200.0
RATE = 7e14
CHUNK_SECONDS = 1.1e-4


@dataclass(frozen=True)
class Plan:
    """How a training call runs and the extra memory it takes (``nbytes``)."""

    computation: str  # "fused" or "torch"
    layout: str  # "rows", "columns", "frozen"
    rows: int = 0  # rows per chunk ("rows")
    keep: int = 0  # columns whose R the statistics pass keeps ("columns")
    cols: int = 0  # columns per chunk ("columns", "frozen")
    nbytes: int = 0
    cost: float = 0.0


@dataclass(frozen=True)
class Shape:
    """What the models read: rows, vocabulary, hidden size, which gradients, fp16, soft-cap, the kernel's blocks,
    and the torch computation's element size and whether it upcasts."""

    n: int
    v: int
    d: int
    need_dw: bool
    need_db: bool
    half: bool  # fp16 (its kept gradients are fp32, its R relative to running maxima)
    soft: bool  # soft-capped
    block_n: int = 128
    block_v: int = 256
    programs: int = 264  # the kernel grid's target programs (KernelConfig.min_programs)
    item: int = 4  # bytes per element of the torch computation's dtype (8: fp64)
    cast: bool = False  # the torch computation upcasts the inputs (half precision)


def _pad8(x: int) -> int:
    return -(-x // 8) * 8


def _row_state(s: Shape, rows: int) -> int:
    """Per-row outputs and scratch, one launch's split buffers, the column sums, a row of ones and the rank-one
    term's partial sums (``fused_pass._rank_one_rows``: at most 64 fp32 columns a program)."""
    splits_rows = max(s.programs * s.block_n, 2 * rows)
    return (56 * s.n + 8 * rows + 20 * min(splits_rows, rows * max(1, -(-s.v // s.block_v))) + 8 * s.d + 2 * s.v
            + 256 * s.programs + 4096)


def _fp16_kept(s: Shape) -> int:
    """fp16 keeps dh and dW in fp32 until backward: their bytes beyond fp16 gradients."""
    return (2 * s.n * s.d + (2 * s.v * s.d if s.need_dw else 0)) if s.half else 0


def rows_bytes(s: Shape, rows: int) -> int:
    direct = rows >= s.n and s.need_dw and not s.half
    extra = 2 if s.need_dw and not s.soft else 0
    b = (rows + extra) * _pad8(s.v) * 2 + _row_state(s, rows)
    if s.need_dw and not s.soft:
        b += (rows + extra) * s.d * 2  # a o h for dW's product
    if not s.soft:
        b += rows * s.d * 4  # dh's fp32 product
    if s.need_dw and not direct:
        b += s.v * s.d * 4  # dW's fp32 accumulator
    if s.half:
        b += rows * -(-s.v // s.block_v) * 4  # the running maxima per tile
    if s.need_db:
        b += 8 * s.v
    return b + _fp16_kept(s)


def columns_bytes(s: Shape, keep: int, cols: int) -> int:
    b = 4 * s.n * s.d + _row_state(s, s.n) + 16 * s.n  # dh's accumulator, the state, G's row terms
    if keep:
        b += (s.n + 2) * (_pad8(keep) * 2 + s.d * 2) + 4 * s.d  # R kept, a o h, the kept columns' sums
    if keep < s.v:
        b += s.n * _pad8(cols) * 2
    if s.need_db:
        b += 4 * s.v + 4 * s.n
    return b + _fp16_kept(s)


def frozen_bytes(s: Shape, cols: int) -> int:
    return 4 * s.n * s.d + s.n * _pad8(cols) * 2 + _row_state(s, s.n) + 20 * s.n


def torch_bytes(s: Shape, rows: int) -> int:
    """The torch computation: two chunks of logits, the statistics; half-precision inputs also the upcast weight, dW
    and dh in fp32 and a chunk's rows of h."""
    b = 2 * rows * s.v * s.item + 10 * s.n * s.item + s.d * s.item + (2 * s.v * s.item if s.need_db else 0)
    if s.cast:
        b += rows * s.d * s.item + s.v * s.d * s.item * (2 if s.need_dw else 1) + s.n * s.d * s.item
    return b


def _mm_seconds(s: Shape) -> float:
    return max(2.0 * s.n * s.d * s.v / RATE, 1e-9)


def _cost(s: Shape, matmuls: float, chunks: int, traffic: float = 0.0) -> float:
    """Time in logits matmuls: ``matmuls`` of them, ``traffic`` bytes moved, ``chunks`` chunks of host time beyond
    the first pass."""
    return matmuls + (traffic / (RATE / FLOP_PER_BYTE) + chunks * CHUNK_SECONDS) / _mm_seconds(s)


def _largest(fixed: int, per: int, budget: int, cap: int, step: int) -> int:
    """The largest count in [step, cap] (a multiple of ``step`` unless ``cap``) with ``fixed + per * count <=
    budget``, or 0."""
    if fixed + per * cap <= budget:
        return cap
    k = (budget - fixed) // per // step * step
    return k if k >= step else 0


def fused_plans(s: Shape, budget: int | None) -> list[Plan]:
    """The fused computation's best plan of each layout within ``budget`` bytes (None: unlimited): rows (not fp16
    with a soft-cap), columns (a trainable head or bias, or fp16 or a soft-cap), frozen (a frozen head otherwise)."""
    big = budget if budget is not None else 1 << 62
    grads = 3.0 if s.need_dw else 2.0
    plans = []
    if not (s.half and s.soft):  # rows: bytes grow linearly with the rows per chunk (R, a o h, dh's rows)
        base = rows_bytes(s, 0)
        per = max(1, (rows_bytes(s, s.block_n) - base) // s.block_n)
        rows = s.n if rows_bytes(s, s.n) <= big else _largest(base, per, big, s.n, s.block_n)
        if rows:
            chunks = -(-s.n // rows)
            traffic = 8.0 * s.v * s.d * chunks + 6.0 * s.v * s.d if s.need_dw and rows < s.n else 0.0
            plans.append(Plan("fused", "rows", rows=rows, nbytes=rows_bytes(s, rows),
                              cost=_cost(s, grads, chunks - 1, traffic)))
    full, step = _pad8(s.v), s.block_v
    if s.need_dw or s.need_db or s.half or s.soft:  # columns: the share not kept recomputed, a chunk at a time
        chunk_cols = max(step, min(full, 4 * MIN_CHUNK_BYTES // (2 * s.n) // step * step))
        cands = []
        widest = _largest(columns_bytes(s, 0, 0), 2 * s.n, big, full, step)  # nothing kept: the widest chunk
        if widest:
            cands.append((0, min(widest, s.v)))
        if s.need_dw and not (s.half or s.soft):  # keep what the budget holds beside a chunk of the usual width
            fixed = columns_bytes(s, step, chunk_cols) - (s.n + 2) * step * 2
            keep = _largest(fixed, 2 * (s.n + 2), big, full, step)
            if keep and keep < s.v:  # (everything kept: the rows layout, with less memory)
                cands.append((keep, min(chunk_cols, s.v - keep)))
        for keep, cols in cands:
            rest = s.v - keep
            plans.append(Plan("fused", "columns", keep=keep, cols=cols, nbytes=columns_bytes(s, keep, cols),
                              cost=_cost(s, grads + rest / s.v, -(-rest // cols) if rest else 0)))
    else:  # a frozen head by columns, every row at once, the logits once
        cols = _largest(frozen_bytes(s, 0), 2 * s.n, big, full, step)
        if cols:
            cols = min(cols, s.v)
            plans.append(Plan("fused", "frozen", cols=cols, nbytes=frozen_bytes(s, cols),
                              cost=_cost(s, grads, -(-s.v // cols) - 1) - 1e-3))  # (ties: columns, measured faster)
    return plans


def torch_plan(s: Shape, budget: int | None) -> Plan | None:
    """The torch computation within ``budget``: chunks as large as it holds (fewer passes over dW, and matmuls of more
    rows: fp32 on an H200 took 1.6-1.7 x longer in chunks of 64 MiB, docs/benchmarks.md); None: ``reference``'s
    default chunk."""
    from .reference import chunk_rows

    rows = chunk_rows(s.n, s.v)
    if budget is not None:
        base = torch_bytes(s, 0)
        rows = min(s.n, max(0, (budget - base) // max(1, torch_bytes(s, 1) - base)))
        if rows < 1:
            return None
    return Plan("torch", "rows", rows=rows, nbytes=torch_bytes(s, rows), cost=0.0)


def best(s: Shape, budget: int | None, computation: str) -> Plan | None:
    """The fastest plan of ``computation`` within ``budget`` (None: unlimited), or None where none fits."""
    if computation == "torch":
        return torch_plan(s, budget)
    plans = fused_plans(s, budget)
    return min(plans, key=lambda p: (p.cost, p.nbytes)) if plans else None


def smallest(s: Shape, computation: str, chunk_bytes: int = 0) -> int:
    """The smallest budget a plan of ``computation`` works within, chunks at least ``chunk_bytes`` where the shape
    has that much (0: one block)."""
    if computation == "torch":
        return torch_bytes(s, 1)
    cols = min(_pad8(s.v), max(s.block_v, chunk_bytes // max(1, 2 * s.n) // s.block_v * s.block_v))
    rows = min(s.n, max(s.block_n, chunk_bytes // max(1, 2 * _pad8(s.v)) // s.block_n * s.block_n))
    cands = [] if s.half and s.soft else [rows_bytes(s, rows)]
    if s.need_dw or s.need_db or s.half or s.soft:
        cands.append(columns_bytes(s, 0, cols))
    else:
        cands.append(frozen_bytes(s, cols))
    return min(cands)


def low_budget(s: Shape, computation: str) -> int:
    """memory="low": ``LOW_BYTES``, or the smallest plan with chunks of ``MIN_CHUNK_BYTES`` where that needs more."""
    return max(LOW_BYTES, smallest(s, computation, MIN_CHUNK_BYTES))


def describe(nbytes: int | float) -> str:
    """Bytes as a short figure (``1.2 GB``, ``180 MB``)."""
    if nbytes >= 1e9:
        return f"{nbytes / 1e9:.1f} GB"
    if nbytes >= 1e6:
        return f"{math.ceil(nbytes / 1e6)} MB"
    return f"{math.ceil(nbytes / 1e3)} kB"


def describe_plan(p: Plan) -> str:
    """A plan in words, as ``hf-lsce env`` and the benchmarks print it."""
    if p.computation == "torch":
        return f"torch, chunks of {p.rows} rows of fp32 logits"
    return "fused, " + {"rows": f"R for {p.rows} rows a chunk", "frozen": f"{p.cols} columns a chunk",
                        "columns": f"R kept for {p.keep} columns, the rest recomputed {p.cols} at a time"}[p.layout]


def recompute_cols(s: Shape, nbytes: int | None) -> int:
    """Columns of G a chunk for a recomputing backward within ``nbytes`` (None: chunks of ``4 MIN_CHUNK_BYTES``), at
    least one block."""
    base = columns_bytes(s, 0, 0)
    room = base + 4 * MIN_CHUNK_BYTES if nbytes is None else nbytes
    return min(s.v, max(s.block_v, _largest(base, 2 * s.n, room, _pad8(s.v), s.block_v)))


# ------------------------------------------------------------------------------------------------ a call's options

MEMORY_MODES = ("auto", "low")
# memory="auto" reads CUDA's free memory only where the fastest plan (times the headroom) exceeds this fraction of the
# device's memory; below it the plan is taken to fit, as any other allocation of the step is
SMALL_BUFFER_FRACTION = 1 / 32


@dataclass(frozen=True)
class Options:
    """How a call runs (``options``)."""

    softcap: float | None
    backend: str
    computation: str = "torch"  # "fused" or "torch"
    plan: Plan | None = None  # the training plan, and the torch computation's chunk (None: the default chunk)
    z_loss: float = 0.0
    need_stats: bool = False
    reduce: bool = False  # the first output is the reduced loss (sum / denom), not per-token losses
    smoothed: bool = True  # False: b = 0 for every token (a float 0), so the fused pass skips dW's rank-one term


def check_memory(memory) -> str:
    """``memory`` validated (``"auto"``, ``"low"`` or a positive number of bytes), as the string the compiled
    operators take; a ``ValueError`` / ``TypeError`` naming it otherwise."""
    if isinstance(memory, str):
        if memory in MEMORY_MODES:
            return memory
        if memory == "fast":
            raise ValueError("memory='fast' was retired in 1.0: memory='auto' (the default) takes the fastest "
                             "computation that fits the GPU's free memory; pass a number of bytes to cap it.")
        raise ValueError(f"memory must be 'auto', 'low' or a number of bytes, got {memory!r}.")
    if isinstance(memory, bool) or not isinstance(memory, numbers.Real):
        raise TypeError(f"memory must be 'auto', 'low' or a number of bytes, got {memory!r} "
                        f"({type(memory).__name__}).")
    if not (memory == memory and memory not in (float("inf"), float("-inf")) and memory > 0):
        raise ValueError(f"memory={memory!r}: a budget is a positive number of bytes (e.g. 2e9), 'auto' or 'low'.")
    return str(int(memory))


def computation(hidden, weight, softcap, backend) -> str:
    """``"fused"`` where the fused computation runs these inputs (``fused_pass.supported``), else ``"torch"``."""
    from .config import fused_config, interpreting

    if backend != "triton" or not (hidden.is_cuda or interpreting()):
        return "torch"
    from .fused_pass import supported

    return "fused" if supported(hidden, weight, softcap, fused_config(hidden.dtype, hidden.device)) else "torch"


def shape_of(hidden, weight, bias, softcap, comp: str, need_dw: bool, need_db: bool) -> Shape:
    """The planner's view of a call (``budget.Shape``), with the fused kernel's blocks on its device."""
    kw = {}
    if comp == "fused":
        from .config import fused_config

        cfg = fused_config(hidden.dtype, hidden.device)
        kw = dict(block_n=cfg.block_n, block_v=cfg.block_v, programs=cfg.min_programs)
    return Shape(hidden.shape[0], weight.shape[0], weight.shape[1], need_dw, need_db and bias is not None,
                 half=hidden.dtype == torch.float16, soft=softcap is not None,
                 item=8 if hidden.dtype == torch.float64 else 4, cast=hidden.dtype in (torch.float16, torch.bfloat16),
                 **kw)


def _head(s: Shape) -> str:
    return f"{s.n} tokens, a {s.v:,} x {s.d} head{'' if s.need_dw else ' (frozen)'}"


def plan_for(s: Shape, comp: str, memory: str, device: torch.device) -> Plan:
    """The fastest plan of ``comp`` within the budget ``memory`` (``check_memory``'s string), or a ``ValueError``
    naming ``memory``, the value and the smallest budget that works (also where the device cannot hold the plan)."""
    from .config import device_memory, free_cuda_memory

    cuda = device.type == "cuda"
    if memory == "low":
        return best(s, low_budget(s, comp), comp)
    if memory == "auto":  # (the cap never below the smallest plan: a large step is limited by free memory only)
        cap = max(AUTO_MAX_BYTES, smallest(s, comp)) if cuda else None
        plan = best(s, cap, comp)
        if not cuda or HEADROOM * plan.nbytes <= SMALL_BUFFER_FRACTION * device_memory(device):
            return plan
        free = free_cuda_memory(device)
        plan = best(s, min(int(free / HEADROOM), cap), comp)
        if plan is None:
            least = smallest(s, comp)
            raise ValueError(f"memory='auto': the GPU has {describe(free)} free, and the op needs at least "
                             f"{least:,} bytes ({describe(least)}) beside it at {_head(s)}: free memory or lower "
                             f"the batch.")
        return plan
    plan = best(s, int(memory), comp)
    if plan is None:
        least = smallest(s, comp)
        raise ValueError(f"memory={memory}: below what the op needs at {_head(s)}; the smallest budget that works "
                         f"is {least:,} bytes ({describe(least)}); pass at least that, or memory='low' "
                         f"({describe(low_budget(s, comp))}).")
    if cuda and plan.nbytes > SMALL_BUFFER_FRACTION * device_memory(device):
        free = free_cuda_memory(device)
        if plan.nbytes > free:
            raise ValueError(f"memory={memory}: its plan takes {plan.nbytes:,} bytes ({describe(plan.nbytes)}) "
                             f"but the GPU has {describe(free)} free; pass memory='auto' or at most {free:,}.")
    return plan


def options(hidden, weight, bias, softcap, backend, z_loss, memory, training: bool, need_dw: bool, need_db: bool,
            need_stats=False, reduce=False, smoothed=True) -> Options:
    """How a call runs: the computation and, for a training call (or the torch computation's chunks), the plan."""
    comp = computation(hidden, weight, softcap, backend) if hidden.shape[0] else "torch"
    plan = None
    if hidden.shape[0] and (training or comp == "torch"):
        s = shape_of(hidden, weight, bias, softcap, comp, need_dw and training, need_db and training)
        plan = plan_for(s, comp, memory, hidden.device)
    return Options(softcap=softcap, backend=backend, computation=comp, plan=plan, z_loss=float(z_loss),
                   need_stats=need_stats, reduce=reduce, smoothed=smoothed)
