"""Where the frozen low-memory call's extra memory goes: the allocations alive at its peak (memory snapshot)."""
import sys, torch
sys.path.insert(0, "benchmarks")
from bench_linear_cross_entropy import SHAPES
from hf_lsce import linear_cross_entropy

for name in sys.argv[1].split(","):
    n, d, v = SHAPES[name]
    g = torch.Generator("cuda").manual_seed(0)
    h = (torch.randn(n, d, device="cuda", generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    linear_cross_entropy(h, w, y, label_smoothing=0.1, memory="low").backward()
    h.grad = None
    torch.cuda.synchronize(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    linear_cross_entropy(h, w, y, label_smoothing=0.1, memory="low").backward()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(name, "extra MB", (torch.cuda.max_memory_allocated() - base) / 1e6)
    # replay the trace: live bytes over time, and the allocations alive at the peak
    live, cur, peak, at_peak = {}, 0, 0, {}
    for dev in snap["device_traces"]:
        for ev in dev:
            if ev["action"] == "alloc":
                live[ev["addr"]] = ev; cur += ev["size"]
                if cur > peak:
                    peak, at_peak = cur, dict(live)
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                cur -= live.pop(ev["addr"])["size"]
    print(" peak of traced allocations MB", peak / 1e6)
    for ev in sorted(at_peak.values(), key=lambda e: -e["size"])[:8]:
        fr = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in ev["frames"]
              if "hf_lsce" in f["filename"] or "torch/_tensor" in f["filename"]][:3]
        print(f"  {ev['size'] / 1e6:9.1f} MB", fr)
