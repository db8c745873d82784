"""``hf-lsce env``: what this machine has, which path the op takes here, and a self-test; for bug reports.

    hf-lsce env [--json] [--no-self-test] [--device cuda:1] [--tokens 8192] [--head 2048,128256]

Versions (Python, torch, CUDA, Triton and the Hugging Face stack, the frameworks when installed), each GPU (name,
compute capability, shared memory, whether the fused kernels' TMA loads and tensor-core dots are there), which
computation, layout and loads the op takes on the device for bf16 / fp16 / fp32 with a trainable and a frozen head
(``memory="auto"``, at the head and token count given: a Llama-3.2-1B head and 8,192 tokens unless told), and a
self-test: a small forward and backward per dtype and head with the automatic and the smallest budget (and the
evaluation statistics) against fp64 torch, each bounded by torch's own error in that dtype. On a machine without a usable GPU it says why and tests the
torch path. Exit status 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import platform
import time
import warnings

import torch

from .ops import config

# Distributions a bug report needs (the name pip knows, the name shown)
PACKAGES = [("torch", "torch"), ("triton", "Triton"), ("transformers", "transformers"), ("trl", "TRL"),
            ("peft", "PEFT"), ("accelerate", "accelerate"), ("datasets", "datasets"), ("deepspeed", "DeepSpeed"),
            ("bitsandbytes", "bitsandbytes"), ("liger-kernel", "liger-kernel"), ("axolotl", "Axolotl"),
            ("llamafactory", "LLaMA-Factory"), ("numpy", "numpy")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The self-test's inputs: a ragged vocabulary (not a multiple of any tile), ignored targets, per-token smoothing
TEST_N, TEST_D, TEST_V = 500, 192, 10007
# Allowed error above torch's own in the same dtype (loss, gradients), as the op's tests bound it (tests/test_ops.py)
LOSS_SLACK, GRAD_SLACK = 1e-4, 1e-2


def versions() -> dict:
    """Installed versions (None: not installed) of Python, hf_lsce and ``PACKAGES``, and torch's CUDA."""
    from importlib import metadata

    from . import __version__

    found = {"Python": platform.python_version(), "hf_lsce": __version__}
    for dist, name in PACKAGES:
        try:
            found[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["torch"] = torch.__version__  # (with its build tag: +cpu, +cu130)
    found["Triton"] = config.triton_version()  # (what imports, or None)
    found["torch CUDA"] = torch.version.cuda
    return found


def cuda_state() -> tuple[int, str | None]:
    """(usable CUDA devices, why none where there are none): a CPU build, no driver, or a driver torch cannot use
    (what ``torch.cuda.is_available`` warns and ``device_count`` raises, in one line)."""
    if torch.version.cuda is None and torch.version.hip is None:
        return 0, "torch is a CPU build (no CUDA)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = torch.cuda.is_available()
            count = torch.cuda.device_count() if available else 0
        except Exception as e:  # noqa: BLE001 - a broken driver or runtime: said, not raised
            return 0, f"CUDA does not initialise: {_line(e)}"
    if count:
        return count, None
    why = next((_line(w.message) for w in caught), "no GPU visible (CUDA_VISIBLE_DEVICES, the driver)")
    return 0, f"CUDA {torch.version.cuda} build, but no usable GPU: {why}"


def gpus(count: int) -> list[dict]:
    """Each visible GPU: name, capability, multiprocessors, memory, shared memory per block, and what the op's
    kernels find there (Triton's tensor-core dots from 8.0; TMA loads with room for their tiles)."""
    out = []
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        smem = getattr(p, "shared_memory_per_block_optin", None)
        out.append(dict(index=i, name=p.name, capability=f"{p.major}.{p.minor}",
                        multiprocessors=p.multi_processor_count,
                        memory_gib=round(p.total_memory / 2**30, 1), shared_memory_kib=smem // 1024 if smem else None,
                        triton=(p.major, p.minor) >= (7, 0), tensor_core_dots=config.compiled_capability(p)[0] >= 8,
                        tma=config.tma_capable(p) and config._has_tensor_descriptors(),
                        tma_switched_off=config.TMA_SWITCH == "0"))
    return out


def routes(device: torch.device, tokens: int, head: tuple[int, int]) -> list[dict]:
    """The computation, layout and loads the op takes on ``device`` for each dtype with a trainable and a frozen head
    of ``head`` = (D, V) over ``tokens`` rows, ``memory="auto"`` (the op's own plan: ``budget.options`` against this
    device's free memory)."""
    from .ops.linear_cross_entropy import _resolve_backend

    d, v = head
    rows = []
    backend = _resolve_backend("auto", device)
    for name, dtype in DTYPES.items():
        for frozen in (False, True):
            row = dict(dtype=name, head="frozen" if frozen else "trainable", backend=backend)
            row.update(_route(device, dtype, frozen, tokens, d, v, backend))
            rows.append(row)
    return rows


def _route(device, dtype, frozen, n, d, v, backend) -> dict:
    from .ops.budget import describe, describe_plan, options

    if device.type == "cuda":  # (a meta tensor would do, but the free memory is what "auto" reads)
        try:
            h = torch.empty(n, d, dtype=dtype, device=device, requires_grad=True)
            w = torch.empty(v, d, dtype=dtype, device=device, requires_grad=not frozen)
        except torch.OutOfMemoryError:
            return dict(path="?", loads=f"the head ({v} x {d}) and {n} tokens do not fit on {device}: --head, --tokens")
    else:
        h = torch.empty(n, d, dtype=dtype, device="meta", requires_grad=True)
        w = torch.empty(v, d, dtype=dtype, device="meta", requires_grad=not frozen)
    try:
        opts = options(h, w, None, None, backend, 0.0, "auto", True, not frozen, False)
    except ValueError as e:
        return dict(path="?", loads=_line(e))
    plan = opts.plan
    if opts.computation == "torch":
        where = "cuBLAS" if device.type == "cuda" else "the CPU"
        path, loads = "torch", f"chunks of {plan.rows} rows of fp32 logits ({where})"
    else:
        from .ops.tiles import tma_ready

        cfg = config.fused_config(dtype, device)
        loads = ("TMA" if tma_ready(cfg, h, w) else "pointer") + f" loads, {_tiles(cfg)}"
        path = describe_plan(plan)
    del h, w
    return dict(path=path, memory=describe(plan.nbytes), loads=loads)


def _tiles(cfg) -> str:
    return f"{cfg.block_n} x {cfg.block_v} x {cfg.block_d} tiles, {cfg.num_warps} warps, {cfg.num_stages} stages"


def self_test(device: torch.device, route_rows: list[dict]) -> list[dict]:
    """A small forward and backward per dtype and head, with ``memory="auto"`` and with the smallest budget (the
    layouts that reach it), and the evaluation statistics per dtype, against fp64: loss, dh and dW errors, each bounded
    by torch's own same-dtype error (logits in that dtype, as Hugging Face computes them) plus a slack."""
    out, refs = [], {}  # (the references per dtype: every head and budget of a dtype runs on the same inputs)
    for row in route_rows:
        dtype = DTYPES[row["dtype"]]
        frozen = row["head"] == "frozen"
        for memory in ("auto", "smallest"):
            out.append(dict(check=f"{row['dtype']} {row['head']}, memory={memory}",
                            **_train_check(device, dtype, frozen, memory, refs)))
    for name, dtype in DTYPES.items():
        out.append(dict(check=f"{name} evaluation statistics", **_eval_check(device, dtype)))
    return out


def _inputs(device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(TEST_N, TEST_D, generator=g) * 2).to(device, dtype)
    w = (torch.randn(TEST_V, TEST_D, generator=g) / TEST_D ** 0.5).to(device, dtype)
    y = torch.randint(0, TEST_V, (TEST_N,), generator=g)
    y[::9] = -100
    b = (torch.rand(TEST_N, generator=g) * 0.2).to(device)
    return h, w, y.to(device), b


def _reference(h, w, y, b, dtype):
    """(loss, dh, dW) of the mean smoothed loss with the logits in ``dtype`` (fp64: the truth)."""
    hh = h.detach().to(dtype).requires_grad_()
    ww = w.detach().to(dtype).requires_grad_()
    logp = torch.log_softmax((hh @ ww.T).double(), -1)
    valid = y >= 0
    tok = -(1 - b.double()) * logp.gather(1, y.clamp(min=0)[:, None])[:, 0] - b.double() * logp.mean(-1)
    loss = torch.where(valid, tok, 0.0).sum() / valid.sum()
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


def _rel(a, r) -> float:
    return float((a.double() - r.double()).norm() / r.double().norm().clamp_min(1e-300))


def _train_check(device, dtype, frozen, memory, refs: dict) -> dict:
    """One training check; ``refs``: the fp64 and same-dtype references by dtype, computed at its first check (a
    trainable head's: a frozen one takes their loss and dh)."""
    from .ops import linear_cross_entropy
    from .ops.budget import computation, shape_of, smallest

    h, w, y, b = _inputs(device, dtype)
    if dtype not in refs:
        refs[dtype] = tuple(_reference(h, w, y, b, dt) for dt in (torch.float64, dtype))
    truth, torch_own = refs[dtype]
    if memory == "smallest":
        comp = computation(h, w, None, "triton" if device.type == "cuda" else "torch")
        memory = smallest(shape_of(h, w, None, None, comp, not frozen, False), comp)
    try:
        t0 = time.perf_counter()
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_(not frozen)
        loss = linear_cross_entropy(hh, ww, y, label_smoothing=b, memory=memory)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failure is the self-test's finding
        return dict(ok=False, error=f"{type(e).__name__}: {_line(e)}")
    errors = dict(loss=_rel(loss.detach(), truth[0]), dh=_rel(hh.grad, truth[1]))
    if not frozen:
        errors["dW"] = _rel(ww.grad, truth[2])
    bounds = {}
    for i, key in enumerate(("loss", "dh", "dW")):
        if key in errors:
            slack = (LOSS_SLACK if key == "loss" else GRAD_SLACK) if dtype != torch.float32 else 0.0
            bounds[key] = _rel(torch_own[i], truth[i]) + slack + 1e-5
    ok = all(errors[k] <= bounds[k] for k in errors)
    return dict(ok=ok, seconds=round(seconds, 3), errors={k: float(f"{e:.2e}") for k, e in errors.items()},
                bounds={k: float(f"{e:.2e}") for k, e in bounds.items()})


def _eval_check(device, dtype) -> dict:
    from .ops import linear_cross_entropy

    h, w, y, b = _inputs(device, dtype, seed=1)
    try:
        with torch.no_grad():
            _, st = linear_cross_entropy(h, w, y, reduction="none", return_stats=True, label_smoothing=0.1)
    except Exception as e:  # noqa: BLE001
        return dict(ok=False, error=f"{type(e).__name__}: {_line(e)}")
    z = h.double() @ w.double().T
    lse = torch.logsumexp(z, -1)
    valid = y >= 0
    nll = torch.where(valid, lse - z.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
    p = torch.softmax(z, -1)
    errors = dict(lse=_rel(st.lse, lse), nll=_rel(st.nll, nll), entropy=_rel(st.entropy, -(p * p.clamp_min(
        1e-300).log()).sum(-1)))
    argmax_agree = float((st.argmax == z.argmax(-1)).double().mean())
    # the statistics come from fp32 math on the given inputs: the bounds are fp32's, not the dtype's
    ok = errors["lse"] < 1e-5 and errors["nll"] < 1e-4 and errors["entropy"] < 1e-4 and argmax_agree > 0.99
    return dict(ok=ok, errors={k: float(f"{e:.2e}") for k, e in errors.items()}, argmax_agreement=argmax_agree)


def _line(e) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def report(device: str | None = None, tokens: int = 8192, head: tuple[int, int] = (2048, 128256),
           run_self_test: bool = True) -> dict:
    """Everything ``hf-lsce env`` shows, as a dict (``--json`` prints it)."""
    info = dict(versions=versions(), platform=f"{platform.system()} {platform.machine()}")
    count, why = cuda_state()
    info["cuda"] = why or f"{count} GPU(s)"
    info["gpus"] = gpus(count)
    dev = torch.device(device) if device else torch.device("cuda", 0) if count else torch.device("cpu")
    floor = ".".join(map(str, config.TRITON_MIN))
    info["triton"] = config.triton_problem() or (
        f"Triton {config.triton_version()} (the fused kernels need >= {floor})" + (
            "" if dev.type == "cuda" else "; no GPU in use, so the op takes its chunked torch path"))
    if dev.type == "cuda" and not count:
        raise ValueError(f"--device {device}: {why}")
    if dev.type == "cuda" and (dev.index or 0) >= count:
        raise ValueError(f"--device {device}: only {count} GPU(s) visible (cuda:0 to cuda:{count - 1})")
    info["device"] = str(dev)
    info["head"] = dict(tokens=tokens, hidden_size=head[0], vocab_size=head[1])
    info["routes"] = routes(dev, tokens, head)
    if run_self_test:
        t0 = time.perf_counter()
        info["self_test"] = self_test(dev, info["routes"])
        info["self_test_seconds"] = round(time.perf_counter() - t0, 2)
        info["passed"] = all(c["ok"] for c in info["self_test"])
    return info


def format_report(info: dict) -> str:
    """The human-readable report."""
    v = info["versions"]
    lines = [f"hf_lsce {v['hf_lsce']}, Python {v['Python']} ({info['platform']})",
             "versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if k not in ("hf_lsce", "Python") and x),
             "not installed: " + (", ".join(k for k, x in v.items() if x is None and k != "torch CUDA") or "-"),
             f"CUDA: {info['cuda']}"]
    for g in info["gpus"]:
        lines.append(f"  GPU {g['index']}: {g['name']}, compute capability {g['capability']}, {g['multiprocessors']} "
                     f"SMs, {g['memory_gib']} GiB, {g['shared_memory_kib']} KiB shared memory per block; Triton "
                     f"{'yes' if g['triton'] else 'no (below 7.0)'}, tensor-core dots "
                     f"{'yes' if g['tensor_core_dots'] else 'no'}, TMA loads {'yes' if g['tma'] else 'no'}"
                     + (" (not taken: HF_LSCE_TMA=0)" if g["tma"] and g["tma_switched_off"] else ""))
    lines.append(f"Triton kernels: {info['triton']}")
    hd = info["head"]
    lines.append(f"training computation on {info['device']} (memory=\"auto\", {hd['tokens']} tokens, head D = "
                 f"{hd['hidden_size']}, V = {hd['vocab_size']}):")
    for r in info["routes"]:
        mem = f", {r['memory']} beside the gradients" if r.get("memory") else ""
        lines.append(f"  {r['dtype']:<5}{r['head']:<10} {r['path']}{mem}: {r['loads']}")
    if "self_test" in info:
        lines.append(f"self-test on {info['device']} against fp64 (N = {TEST_N}, D = {TEST_D}, V = {TEST_V}; bound: "
                     "torch's own error in that dtype + slack):")
        for c in info["self_test"]:
            status = "ok  " if c["ok"] else "FAIL"
            if "error" in c:
                detail = c["error"]
            else:
                detail = ", ".join(f"{k} {e:.1e}" + (f" (<= {c['bounds'][k]:.1e})" if "bounds" in c else "")
                                   for k, e in c["errors"].items())
                if "argmax_agreement" in c:
                    detail += f", argmax {c['argmax_agreement']:.1%} equal"
            lines.append(f"  {status} {c['check']}: {detail}")
        lines.append(f"self-test: {'passed' if info['passed'] else 'FAILED'} ({len(info['self_test'])} checks, "
                     f"{info['self_test_seconds']} s)")
    return "\n".join(lines)


def main(args) -> tuple[str, int]:
    """``hf-lsce env`` (arguments parsed by ``hf_lsce.cli``, which prints the text): the report as text or JSON, and
    the exit code: 0 when the self-test passed (or was skipped), else 1."""
    import json

    info = report(args.device, args.tokens, tuple(args.head), run_self_test=not args.no_self_test)
    return (json.dumps(info, indent=1) if args.json else format_report(info)), 0 if info.get("passed", True) else 1
