"""Experiment (issue 41, the op's host time): inclusive host time of each stage of one training call (1 x 256 tokens at
SmolLM2's head, b = 0), the GPU kept busy so only the enqueue is timed; wrappers around the stages' functions, every
Triton launch and the autograd function's forward and backward. Run on one pinned core:

    taskset -c 3 python tools/gpu/host_stages_busy.py
"""
import collections, functools, sys, time, statistics
import torch
sys.path.insert(0, ".")
T = collections.Counter(); C = collections.Counter()
def timed(owner, name, label=None):
    fn = getattr(owner, name)
    key = label or f"{getattr(owner, '__name__', owner)}.{name}"
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            T[key] += time.perf_counter_ns() - t0; C[key] += 1
    setattr(owner, name, wrapper)
import hf_lsce.ops.linear_cross_entropy  # noqa
lce = sys.modules["hf_lsce.ops.linear_cross_entropy"]
import hf_lsce.ops.paths as paths, hf_lsce.ops.fused_pass as fp, hf_lsce.ops.prepare as prep, hf_lsce.ops.train_pass as tp
import hf_lsce.ops.checks as checks
from triton.runtime.jit import JITFunction
for owner, name in [(lce, "_validate"), (lce, "_validate_options"), (lce, "_resolve_backend"), (lce, "check_summary"),
                    (lce, "use_train_pass"), (lce, "training_options"), (lce, "notify_training_call"), (prep, "prepare"),
                    (lce, "statistics_and_gradients"), (lce, "loss_terms"), (fp, "_column_sums"), (fp, "_row_offsets"),
                    (fp, "_exp_tiles"), (fp, "_direct_dw"), (fp, "_rank_one_rows"), (fp, "_mm_once"), (fp, "mm_f32"),
                    (fp, "layout"), (tp, "scale_by"), (checks, "raise_pending_errors"), (checks, "_Pending")]:
    timed(owner, name)
timed(JITFunction, "run", "every Triton launch")
timed(fp, "triton_fused_pass")
lce.linear_cross_entropy_orig = lce.linear_cross_entropy
timed(lce, "linear_cross_entropy")
F_ = lce._LinearCrossEntropy
fwd, bwd = F_.forward, F_.backward
def fwd_w(ctx, *a):
    t0 = time.perf_counter_ns()
    try: return fwd(ctx, *a)
    finally: T["Function.forward body"] += time.perf_counter_ns() - t0; C["Function.forward body"] += 1
def bwd_w(ctx, *a):
    t0 = time.perf_counter_ns()
    try: return bwd(ctx, *a)
    finally: T["Function.backward body"] += time.perf_counter_ns() - t0; C["Function.backward body"] += 1
F_.forward = staticmethod(fwd_w); F_.backward = staticmethod(bwd_w)
orig_apply = F_.apply
def apply_w(*a):
    t0 = time.perf_counter_ns()
    try: return orig_apply(*a)
    finally: T["Function.apply"] += time.perf_counter_ns() - t0; C["Function.apply"] += 1
F_.apply = apply_w
sys.path.insert(0, "benchmarks")
from host_overhead import _head_inputs
h, w, y = _head_inputs("cuda")
call = lce.linear_cross_entropy
def step():
    t0 = time.perf_counter_ns()
    loss = call(h, w, y, label_smoothing=0.0, shift=True)
    t1 = time.perf_counter_ns()
    loss.backward()
    t2 = time.perf_counter_ns()
    T["TOTAL forward call"] += t1 - t0; T["TOTAL .backward()"] += t2 - t1
for _ in range(60): step()
torch.cuda.synchronize()
T.clear(); C.clear()
iters = 0
for _ in range(8):
    torch.cuda._sleep(300_000_000)
    for _ in range(40): step(); iters += 1
    torch.cuda.synchronize()
for k, v in sorted(T.items(), key=lambda kv: -kv[1]):
    print(f"{k:45s} {v / iters / 1e3:8.1f} us/call  ({C[k] / iters:.1f} calls)")
