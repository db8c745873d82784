"""Lower the fused path's logits kernel to Triton IR for a GPU target, on the CPU (no GPU, no interpreter): both loads
(TMA descriptors and pointers) x the flags that change its code (fp16's online mode included), for sm80 and sm90. Prints one JSON line per variant
("ok" or the compiler's last line). Then the fp16 kernel's PTX for sm75 and sm80, and each GPU generation's pointer
tiles compiled for it with the shared memory they take. Run by tests/test_kernel_lowering.py in a process without
TRITON_INTERPRET, since the interpreter runs Python and never compiles a branch it does not take."""
import itertools
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

try:
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
except ImportError as e:  # Triton's compiler API moved: the test skips with this line
    print(json.dumps(dict(unavailable=str(e))))
    sys.exit(0)

import hf_lsce.ops.fused_pass as fp  # noqa: E402

fn = fp._exp_tiles_kernel
FLOATS = ("r_exp_max", "softcap")
for arch, tma, stats, fixup, store, softcap, bias, online in itertools.product(
        (80, 90), (True, False), (True, False), (True, False), (True, False), (True, False), (True, False),
        (False, True)):
    if (tma and arch < 90) or (online and (fixup or softcap)):  # (fp16's online mode: no fix-up, no soft-cap)
        continue
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    dt = "fp16" if online else "bf16"
    types = dict(R=f"*{dt}", B=f"*{dt}", C="*fp32", MT="*fp32", S_OUT="*fp32", T_OUT="*fp32", M_OUT="*fp32",
                 AM_OUT="*i32", SZ_OUT="*fp32", H=f"tensordesc<{dt}[128, 64]>" if tma else f"*{dt}",
                 W=f"tensordesc<{dt}[256, 64]>" if tma else f"*{dt}")
    consts = dict(HAS_BIAS=bias, DOT_PRECISION="tf32", UPCAST=False, STATS=stats, FIXUP=fixup, STORE=store,
                  SOFTCAP=softcap, ONLINE=online, TMA=tma, BLOCK_N=128, BLOCK_V=256, BLOCK_D=64)
    signature = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "fp32" if p.name in FLOATS else "i32")
                 for p in fn.params}
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    variant = dict(arch=arch, tma=tma, stats=stats, fixup=fixup, store=store, softcap=softcap, bias=bias,
                   online=online)
    try:
        src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
        print(json.dumps(dict(variant, result="ok")), flush=True)
    except Exception as e:  # noqa: BLE001 - reported per variant
        print(json.dumps(dict(variant, result=str(e).strip().splitlines()[-1][:300])), flush=True)

# The premise of the path choice on Turing and Volta (config.KernelConfig.mma_dot): Triton lowers the fp16 kernel's
# tl.dot to tensor-core MMA from sm80 only. Compiled to PTX (no GPU needed); one line per target.
import re  # noqa: E402

import triton  # noqa: E402

for arch in (75, 80):
    types = dict(R="*fp16", B="*fp16", C="*fp32", MT="*fp32", S_OUT="*fp32", T_OUT="*fp32", M_OUT="*fp32",
                 AM_OUT="*i32", SZ_OUT="*fp32", H="*fp16", W="*fp16")
    consts = dict(HAS_BIAS=False, DOT_PRECISION="tf32", UPCAST=False, STATS=False, FIXUP=False, STORE=True,
                  SOFTCAP=False, ONLINE=True, TMA=False, BLOCK_N=128, BLOCK_V=128, BLOCK_D=64)
    signature = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "fp32" if p.name in FLOATS else "i32")
                 for p in fn.params}
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in consts.items()})
    try:
        ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8, num_stages=2)).asm["ptx"]
        print(json.dumps(dict(ptx_arch=arch, mma=sorted(set(re.findall(r"\bmma\.[a-z0-9.]+", ptx))))), flush=True)
    except Exception as e:  # noqa: BLE001 - no PTX back end here: the test skips that part
        print(json.dumps(dict(ptx_arch=arch, unavailable=str(e).strip().splitlines()[-1][:300])), flush=True)

# The pointer-load tiles each GPU generation takes (config.pointer_tiles, from its shared memory per block), compiled
# for it as a launch specialises them (unit D strides, 16-byte aligned pointers and sizes): the shared memory the
# kernel takes must fit the card's, or it would not launch there. One line per (card, variant).
from hf_lsce.ops.config import pointer_tiles  # noqa: E402

CARDS = {"A100": (80, 166912), "A10, RTX 30xx": (86, 101376), "L4, RTX 40xx": (89, 101376),
         "RTX 50xx": (120, 101376), "H100 (HF_LSCE_TMA=0)": (90, 232448)}
ALIGNED = ("H", "W", "R", "B", "C", "MT", "S_OUT", "T_OUT", "M_OUT", "AM_OUT", "SZ_OUT", "stride_rn", "stride_hn",
           "stride_wv", "stride_mt", "N", "V", "D")
for card, (arch, smem) in CARDS.items():
    bn, bv, bd, stages = pointer_tiles(smem)
    for online in (False, True):
        dt = "fp16" if online else "bf16"
        types = dict(R=f"*{dt}", B=f"*{dt}", C="*fp32", MT="*fp32", S_OUT="*fp32", T_OUT="*fp32", M_OUT="*fp32",
                     AM_OUT="*i32", SZ_OUT="*fp32", H=f"*{dt}", W=f"*{dt}")
        consts = dict(HAS_BIAS=True, DOT_PRECISION="tf32", UPCAST=False, STATS=True, FIXUP=not online, STORE=True,
                      SOFTCAP=not online, ONLINE=online, TMA=False, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd,
                      stride_hd=1, stride_wd=1)
        signature = {p.name: "constexpr" if p.is_constexpr or p.name in consts else types.get(
            p.name, "fp32" if p.name in FLOATS else "i32") for p in fn.params}
        src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in consts.items()},
                        {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED})
        row = dict(card=card, arch=arch, smem=smem, tiles=[bn, bv, bd, stages], dtype=dt)
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=8, num_stages=stages))
            print(json.dumps(dict(row, shared=kernel.metadata.shared)), flush=True)
        except Exception as e:  # noqa: BLE001 - no back end for this target here: the test says so
            print(json.dumps(dict(row, unavailable=str(e).strip().splitlines()[-1][:300])), flush=True)
