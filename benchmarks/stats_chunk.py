"""Settled experiment: the chunk of fp32 logits for the statistics through cuBLAS (evaluation where Triton dots are FMA), against the forward kernel; H100, N = 8,192, realistic inputs."""
import json, os, sys
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch, triton.testing as tt
from real_inputs import fitted_params, realistic_batch
from hf_lsce.ops.train_pass import triton_train_pass
from hf_lsce.ops.forward import triton_forward
from hf_lsce.ops.config import forward_config

rows = []
for name, (n, d, v) in {"gemma3-270m": (8192, 640, 262144), "llama3-8b": (8192, 4096, 128256),
                        "smollm2-135m": (8192, 576, 49152)}.items():
    for dt in (torch.bfloat16, torch.float32):
        h, w, y = realistic_batch(n, d, v, seed=0, device="cuda", dtype=dt, **fitted_params())
        y = y.clamp(min=-1)
        with torch.no_grad():
            for mb in (64, 256, 1024, 2048):
                torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
                f = lambda: triton_train_pass(h, w, None, y, None, None, None, need_dh=False, need_dw=False,
                                              need_db=False, chunk_bytes=mb << 20)
                ms = tt.do_bench(f, warmup=50, rep=300, return_mode="median")
                rows.append(dict(shape=name, dtype=str(dt)[6:], route=f"cuBLAS {mb} MiB", ms=ms,
                                 extra_mb=(torch.cuda.max_memory_allocated() - base) / 1e6))
                print(json.dumps(rows[-1]), flush=True)
            cfg = forward_config(dt, h.device)
            f = lambda: triton_forward(h, w, None, y, None, cfg, stats=False)
            ms = tt.do_bench(f, warmup=50, rep=300, return_mode="median")
            rows.append(dict(shape=name, dtype=str(dt)[6:], route="forward kernel", ms=ms)); print(json.dumps(rows[-1]), flush=True)
        del h, w
out = os.environ.get("OUT", ".")
json.dump(rows, open(os.path.join(out, "probe_stats_chunk.json"), "w"), indent=1)
