"""Experiment (issue 41): host time per training call of the op, before and after a change, beside HF's loss.

SmolLM2 head (1 x 256 tokens, bf16: the GPU idles), the best of 9 blocks of 100 forward+backward calls; with
--hf also HF's loss (ForCausalLMLoss at b = 0, the Trainer's LabelSmoother at b = 0.1) in the same process. Run
interleaved with an older tree on one pinned core, e.g. `git archive OLD hf_lsce benchmarks | tar -x -C old`, then
three times: from the old tree's root `PYTHONPATH=$PWD taskset -c 3 python $NEW/tools/gpu/host_ab.py before`, and from
the new one's `taskset -c 3 python tools/gpu/host_ab.py after --hf` (at 72eba57: docs/benchmarks.md, the host).
"""
import sys, time, statistics
import torch
import torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from host_overhead import _head_inputs
from hf_lsce import linear_cross_entropy
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.trainer_pt_utils import LabelSmoother
h, w, y = _head_inputs("cuda")


def measure(f):
    for _ in range(100):
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(100):
            f()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 10)
    return min(out), statistics.median(out)


for b in (0.0, 0.1):
    sm = LabelSmoother(epsilon=b)

    def hf():
        z = F.linear(h, w)
        (sm({"logits": z}, y, shift_labels=True) if b else ForCausalLMLoss(z, y, w.shape[0])).backward()

    def ours():
        linear_cross_entropy(h, w, y, label_smoothing=b, shift=True).backward()
    line = f"{sys.argv[1]} b={b}: ours min {measure(ours)[0]:.3f}"
    if "--hf" in sys.argv:
        m, md = measure(hf)
        line += f" | HF min {m:.3f}"
    print(line, flush=True)
