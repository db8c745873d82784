"""Compile every Triton kernel of ``hf_lsce.ops`` for GPU targets on the CPU, with the installed Triton's own compiler
(no GPU; any Triton from 3.0 on: only its public ``warmup`` API is used, with a stand-in driver naming the target).

1. Record (a child process under ``TRITON_INTERPRET=1``): the op runs its layouts on small CPU inputs (bf16 / fp16 /
   fp32, trainable and frozen, bias, soft-caps on either side of the fused pass's limit, every layout of
   ``budget.Plan``, per-token losses with statistics, an lse output's gradient) with each target's kernel configuration
   patched in (the GPU's logits tiles: TMA on sm90, each generation's pointer tiles, Turing's torch computation), and
   every kernel launch is recorded:
   the kernel, its arguments' dtypes, integer values and constexprs, warps and stages. The row kernels keep the
   interpreter's block sizes.
2. Compile (this process, no interpreter): each distinct launch, through ``kernel.warmup`` for its target, to PTX and
   cubin. One JSON line per (target, kernel, specialisation): ``"ok"`` with the shared memory it takes, or the
   compiler's last line.
3. The fp16 logits kernel's PTX for sm75 and sm80: Triton lowers its dot to tensor-core MMA from sm80 only (why
   Turing and Volta take the torch computation, ``config.KernelConfig.mma_dot``). Then each GPU generation's pointer tiles
   (``config.pointer_tiles``), compiled as a launch specialises them, with the shared memory they take.

The interpreter never compiles a branch it does not take: a TMA loop left where pointer inputs reach it passed every
interpreter test and failed to compile on an H100. Run by ``tests/test_kernel_lowering.py`` and, for each Triton a
torch release brings, by ``tools/triton_matrix.py``.

    python tests/scripts/lower_kernels.py [--targets sm90-tma,sm80]   # JSON lines on stdout; exit 0 whatever compiled
    python tests/scripts/lower_kernels.py --launches F --save         # record only, into F (this Triton's interpreter)
    python tests/scripts/lower_kernels.py --launches F                # compile F's launches with this Triton

Each compilation job runs in a process of its own, so a compiler that aborts (an old Triton's C++ assertion) is a row
``{"job": ..., "crashed": ...}``. Triton's interpreter changed more than its compiler (before 3.3 it fails on this
code), so tools/triton_matrix.py records once with the newest Triton and compiles the same launches with each one.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

# target -> (arch, shared memory per block, TMA, Triton's dots are MMA)
TARGETS = {"sm90-tma": (90, 232448, True, True), "sm90-pointers": (90, 232448, False, True),
           "sm80": (80, 166912, False, True), "sm86": (86, 101376, False, True), "sm75": (75, 65536, False, False)}
CARDS = {"A100": (80, 166912), "A10, RTX 30xx": (86, 101376), "L4, RTX 40xx": (89, 101376),
         "RTX 50xx": (120, 101376), "H100 (HF_LSCE_TMA=0)": (90, 232448)}


# ------------------------------------------------------------------------------------------------------ 1. record
def _record(target: str) -> list[dict]:
    """The distinct kernel launches of the op's paths with ``target``'s configuration (under the interpreter)."""

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import hf_lsce.ops.config as config
    from hf_lsce import linear_cross_entropy

    arch, smem, tma, mma = TARGETS[target]
    tma = tma and config._has_tensor_descriptors()
    bn, bv, bd, stages = config.pointer_tiles(smem)

    def fused(dtype, device, interp):  # the GPU's tiles (UPCAST kept: the interpreter's bf16 dot needs it)
        prec = "ieee" if dtype == torch.float32 else "tf32"
        upcast = dtype == torch.bfloat16
        if dtype == torch.float32:
            return config.KernelConfig(64, 64, 32, 4, 3, prec, 264, upcast_dot=upcast, mma_dot=mma)
        if tma:
            return config.KernelConfig(128, 256, 64, 8, 3, prec, 264, min_splits=2, tma=True, upcast_dot=upcast)
        return config.KernelConfig(bn, bv, bd, 8, stages, prec, 264, min_splits=2, upcast_dot=upcast, mma_dot=mma)

    config._fused_config = fused
    import hf_lsce.ops.budget as bud
    from hf_lsce.ops.budget import Plan

    plans = {"rows": Plan("fused", "rows", rows=40), "row chunks": Plan("fused", "rows", rows=16),
             "columns kept": Plan("fused", "columns", keep=96, cols=64), "columns": Plan("fused", "columns", cols=64),
             "frozen": Plan("fused", "frozen", cols=64)}
    real_plan = bud.plan_for
    launches: dict[str, dict] = {}
    original = InterpretedFunction.__getitem__

    def getitem(self, grid):
        launcher = original(self, grid)

        def run(*args, **kwargs):
            spec = dict(module=self.fn.__module__, kernel=self.fn.__name__,
                        args=[_describe(a) for a in args], kwargs={k: _describe(v) for k, v in kwargs.items()})
            # one launch per compiled variant: integer arguments matter only as 1 or not (Triton specialises on it;
            # a divisibility by 16 changes the code's vector widths, not whether it compiles)
            key = dict(spec, args=[a == 1 if type(a) is int else a for a in spec["args"]])
            launches.setdefault(json.dumps(key, sort_keys=True), spec)
            return launcher(*args, **kwargs)
        return run

    InterpretedFunction.__getitem__ = getitem
    n, v, d = 40, 300, 40
    g = torch.Generator().manual_seed(0)
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    # (dtype, layout, frozen, bias, softcap, call): each kernel and flag the layouts launch, once
    cases = [(dt, name, frozen, bias, cap, "train") for dt in (bf16, fp16) for name in plans
             for frozen in (False, True) for bias, cap in ((True, None), (False, 30.0))]
    cases += [(fp32, None, False, True, 30.0, "train"), (bf16, "rows", False, False, 60.0, "train"),
              (bf16, "rows", False, False, None, "tokens"), (bf16, "columns", False, True, 30.0, "lse")]
    cases += [(dt, None, True, bias, cap, "eval") for dt in (bf16, fp16, fp32) for bias, cap in
              ((True, None), (False, 30.0), (False, 60.0))]
    for dtype, name, frozen, bias, softcap, call in cases:
        bud.plan_for = (lambda *a, _p=plans[name], **k: _p) if name else real_plan
        h = (torch.randn(n, d, generator=g) * 0.5).to(dtype).requires_grad_(call != "eval")
        w = (torch.randn(v, d, generator=g) * 0.5).to(dtype).requires_grad_(not frozen and call != "eval")
        b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
        y = torch.randint(0, v, (n,), generator=g)
        y[::7] = -100
        kw = dict(bias=b, softcap=softcap, label_smoothing=0.1, backend="triton")
        try:
            if call == "train":
                linear_cross_entropy(h, w, y, **kw).backward()
            elif call == "tokens":
                out = linear_cross_entropy(h, w, y, reduction="none", **kw)
                out.backward(torch.rand(out.shape, generator=g, dtype=out.dtype))
            elif call == "lse":
                loss, lse = linear_cross_entropy(h, w, y, return_lse=True, **kw)
                (loss + lse.sum()).backward()
            else:
                linear_cross_entropy(h, w, y, reduction="none", return_stats=True, **kw)
        except Exception as e:  # noqa: BLE001 - the record says which case failed under this Triton's interpreter
            text = str(e).strip().splitlines()
            launches[f"error {len(launches)}"] = dict(
                error=f"{str(dtype)[6:]}, layout {name}, frozen {frozen}, bias {bias}, softcap {softcap}, {call}: "
                      f"{type(e).__name__}: {text[-1][:300] if text else ''}")
    bud.plan_for = real_plan
    return list(launches.values())


def _describe(x):
    """A launch argument as the compiler specialises it: tensors by dtype (and alignment), descriptors by block."""
    import torch

    if isinstance(x, torch.Tensor):
        return dict(tensor=str(x.dtype).replace("torch.", ""), aligned=x.data_ptr() % 16 == 0)
    if type(x).__name__ == "TensorDescriptor":
        return dict(descriptor=str(x.base.dtype).replace("torch.", ""), shape=list(x.shape),
                    strides=list(x.strides), block=list(x.block_shape))
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    return dict(unknown=type(x).__name__)


# ----------------------------------------------------------------------------------------------------- 2. compile
class _Target:
    """A stand-in for Triton's active driver: the target to compile for, no device (``warmup`` compiles, never
    launches). The device index is the architecture, so each target keeps its own kernel cache."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_device(self):
        return self.arch

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)

    def set_current_device(self, device):
        pass

    def get_benchmarker(self):  # (Triton 3.2 and 3.3 ask at ``triton.autotune``, when the module is imported)
        return lambda *args, **kwargs: [0.0]


def _rebuild(x):
    import torch
    from triton.runtime.jit import MockTensor

    if isinstance(x, dict) and "tensor" in x:
        return MockTensor(getattr(torch, x["tensor"]))
    if isinstance(x, dict) and "descriptor" in x:
        from triton.tools.tensor_descriptor import TensorDescriptor

        base = MockTensor(getattr(torch, x["descriptor"]))  # (Triton 3.4's MockTensor takes no shape)
        base.shape = x["shape"]
        return TensorDescriptor(base, x["shape"], x["strides"], x["block"])
    return x


def _kernels():
    """Every Triton kernel of hf_lsce.ops a host function launches: name -> (JIT function, autotuner or None)."""
    import importlib
    import pkgutil

    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import hf_lsce.ops as ops

    driver.set_active(_Target(90))  # (before the kernels' modules: some Tritons ask the driver at import)

    found, tuners = {}, {}
    for info in pkgutil.iter_modules(ops.__path__):
        mod = importlib.import_module(f"hf_lsce.ops.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel") and obj.__module__ == mod.__name__:
                found[name] = obj
            elif isinstance(obj, Autotuner):
                tuners[obj.fn.__name__] = obj
    return {name: (fn, tuners.get(name)) for name, fn in found.items()}


def _compile(fn, args, kwargs, arch):
    """``fn`` compiled for ``arch`` from the recorded launch: (result, shared memory bytes, PTX)."""
    from triton.runtime import driver

    driver.set_active(_Target(arch))
    try:
        kernel = fn.warmup(*[_rebuild(a) for a in args], grid=(1,), **{k: _rebuild(v) for k, v in kwargs.items()})
        return "ok", kernel.metadata.shared, kernel.asm.get("ptx", "")
    except Exception as e:  # noqa: BLE001 - reported per launch
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[-1][:300] if text else ''}", None, ""


def _compile_target(target: str, launches: list[dict], kernels: dict) -> None:
    """Compile ``target``'s recorded launches; one JSON line each."""
    arch, _, tma, _ = TARGETS[target]
    if tma and not _descriptors():
        print(json.dumps(dict(target=target, skipped="no tensor descriptors in this Triton (< 3.4): the op takes "
                                                    "pointer loads on sm90 (sm90-pointers)")), flush=True)
        return
    tuned = set()
    for spec in launches:
        if "error" in spec:
            print(json.dumps(dict(target=target, interpreter_error=spec["error"])), flush=True)
            continue
        fn, tuner = kernels[spec["kernel"]]
        kwargs = dict(spec["kwargs"])
        if "UPCAST" in kwargs:  # the GPU's dots take the inputs' dtype (only the interpreter's bf16 dot needs fp32)
            kwargs["UPCAST"] = False
        variants = [(kwargs, "")]
        if tuner is not None and spec["kernel"] not in tuned:  # the autotuned twin: each configuration, once
            tuned.add(spec["kernel"])
            variants += [({**kwargs, **c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages},
                          f"autotune {c.kwargs}") for c in tuner.configs]
        for kw, note in variants:
            result, shared, _ = _compile(fn, spec["args"], kw, arch)
            flags = {k: v for k, v in kw.items() if k.isupper() or k.startswith("num_")}
            print(json.dumps(dict(target=target, arch=arch, kernel=spec["kernel"], flags=flags, note=note,
                                  result=result, shared=shared)), flush=True)


def _descriptors() -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _compile_extras(kernels: dict, job: str) -> None:
    """The fp16 logits kernel's dots on sm75 and sm80 (``ptx``), or one GPU generation's pointer tiles (``card:``)."""
    import torch

    from hf_lsce.ops.config import pointer_tiles

    fn = kernels["_exp_tiles_kernel"][0]
    half, f32, i32 = torch.float16, torch.float32, torch.int32

    def exp_tiles_args(dt):
        return [dt, dt, dt, dt, f32, f32, f32, f32, f32, i32, f32, f32, torch.int64, 1024, 4096, 64, 2, 4096, 0, 4096,
                64, 1, 64, 1, 16, 80.0, 1.0]

    if job == "ptx":
        for arch in (75, 80):
            flags = dict(HAS_BIAS=False, DOT_PRECISION="tf32", UPCAST=False, STATS=False, FIXUP=False, STORE=True,
                         SOFTCAP=False, ONLINE=True, GRAD=False, TMA=False, BLOCK_N=128, BLOCK_V=128, BLOCK_D=64,
                         EVEN_D=True, num_warps=8,
                         num_stages=2)
            result, _, ptx = _compile(fn, exp_tiles_args(half), flags, arch)
            print(json.dumps(dict(ptx_arch=arch, result=result,
                                  mma=sorted(set(re.findall(r"\bmma\.[a-z0-9.]+", ptx))))), flush=True)
        return
    card = job.split(":", 1)[1]
    arch, smem = CARDS[card]
    bn, bv, bd, stages = pointer_tiles(smem)
    for online in (False, True):
        dt = half if online else torch.bfloat16
        flags = dict(HAS_BIAS=True, DOT_PRECISION="tf32", UPCAST=False, STATS=True, FIXUP=not online, STORE=True,
                     SOFTCAP=not online, ONLINE=online, GRAD=False, TMA=False, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd,
                     EVEN_D=True, num_warps=8, num_stages=stages)
        result, shared, _ = _compile(fn, exp_tiles_args(dt), flags, arch)
        print(json.dumps(dict(card=card, arch=arch, smem=smem, tiles=[bn, bv, bd, stages], dtype=str(dt)[6:],
                              result=result, shared=shared)), flush=True)


def _option(name: str, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> int:
    if "--record" in sys.argv:  # (a child: one target's launches, under the interpreter)
        print(json.dumps(_record(_option("--record"))))
        return 0
    targets = _option("--targets", ",".join(TARGETS)).split(",")
    saved = _option("--launches")
    os.environ.pop("TRITON_INTERPRET", None)
    if "--job" in sys.argv:  # (a child: one target's compilation, or the extras, from the saved launches)
        kernels, job = _kernels(), _option("--job")
        if job in TARGETS:
            with open(saved) as f:
                _compile_target(job, json.load(f)[job], kernels)
        else:
            _compile_extras(kernels, job)
        return 0
    import tempfile

    import triton

    print(json.dumps(dict(triton=triton.__version__, kernels=sorted(_kernels()))), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if saved is None or "--save" in sys.argv:  # record with this Triton's interpreter
            launches = {}
            for target in targets:
                r = subprocess.run([sys.executable, __file__, "--record", target],
                                   env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True)
                if r.returncode != 0:
                    print(json.dumps(dict(target=target, record_failed=(r.stderr.strip().splitlines() or [""])[-1][
                        :300])), flush=True)
                    continue
                launches[target] = json.loads(r.stdout.strip().splitlines()[-1])
            if "--save" in sys.argv:  # for other Tritons' compilers (tools/triton_matrix.py): no compilation here
                with open(saved, "w") as f:
                    json.dump(launches, f)
                return 0
            saved = os.path.join(tmp, "launches.json")
            with open(saved, "w") as f:
                json.dump(launches, f)
        with open(saved) as f:
            recorded = json.load(f)
        # each job in a process of its own: a compiler that aborts (an assertion in an old Triton's C++) is a row
        jobs = [t for t in targets if t in recorded] + ["ptx"] + [f"card:{card}" for card in CARDS]
        for job in jobs:
            r = subprocess.run([sys.executable, __file__, "--job", job, "--launches", saved], capture_output=True,
                               text=True)
            sys.stdout.write(r.stdout)
            if r.returncode != 0:
                last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1][:300]
                print(json.dumps(dict(job=job, crashed=last)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
