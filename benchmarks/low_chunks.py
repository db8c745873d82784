"""memory='low' against its chunk size (32 / 64 / 128 MiB) and the default, trainable and frozen, at three heads;
a kernel breakdown of memory='low' at Gemma-3-270m (torch.profiler). Scratch experiment (not kept in the tree)."""
import json, os, sys
import torch, triton
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import bench_linear_cross_entropy as B
from real_inputs import fitted_params, realistic_batch
from hf_lsce import linear_cross_entropy
import hf_lsce.ops.config as config

do_bench = triton.testing.do_bench
rows = []
for shape in ["gemma3-270m", "gemma2-2b", "llama3-8b"]:
    n, d, v = B.SHAPES[shape]
    h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", **fitted_params())
    for head in ["trainable", "frozen"]:
        frozen = head == "frozen"
        r = dict(shape=shape, head=head, floor=B.floor_ms(h, w, frozen, do_bench))
        r["default"] = B.measure(lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b),
                                 h, w, y, 0.1, None, frozen, do_bench, True)
        for mib in (32, 64, 128):
            config.LOW_MEMORY_CHUNK_BYTES = mib << 20
            r[f"low{mib}"] = B.measure(lambda hh, ww, yy, b, cap: linear_cross_entropy(hh, ww, yy, label_smoothing=b,
                                       memory="low"), h, w, y, 0.1, None, frozen, do_bench, True)
        config.LOW_MEMORY_CHUNK_BYTES = 32 << 20
        print(json.dumps(r), flush=True)
        rows.append(r)
    if shape == "gemma3-270m":
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        for _ in range(3):
            linear_cross_entropy(hh, ww, y, label_smoothing=0.1, memory="low").backward()
        torch.cuda.synchronize()
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                hh.grad = ww.grad = None
                linear_cross_entropy(hh, ww, y, label_smoothing=0.1, memory="low").backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    del h, w, y
    torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "low_chunks.json"), "w"), indent=1)
