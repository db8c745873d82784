"""Where a bf16 Trainer step's time goes, HF's loss against the patch (issue 27: SmolLM2-135M at b = 0 ran at
0.93 x HF's tokens/s although the op alone is faster than HF's logits path). torch.profiler over the timed steps of
``bench_trainer.run_one`` (the same model, data and Trainer arguments as the benchmark): per method the step's wall
time, the CUDA kernel time per step, and the kernels that differ most. Writes $OUT/profile_trainer_step.{txt,json}.

    python benchmarks/experiments/profile_trainer_step.py [--model smollm2-135m-config] [--b 0]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from bench_trainer import run_one  # noqa: E402


def profiled(model, method, b, steps, out_dir, device="cuda"):
    from transformers import TrainerCallback

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                  schedule=torch.profiler.schedule(wait=0, warmup=2, active=steps, repeat=1))

    class CB(TrainerCallback):
        def on_train_begin(self, *a, **k):
            prof.start()

        def on_step_end(self, *a, **k):
            prof.step()

        def on_train_end(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            prof.stop()
    batch, seq = (8, 1024) if device == "cuda" else (2, 32)
    row = run_one(model, method, b, batch, seq, steps, out_dir, device, callbacks=[CB()])
    kernels, cpu = {}, {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] = (t / 1e3 / steps, e.count // steps)
        elif e.device_type == torch.autograd.DeviceType.CPU:  # host side: aten ops, runtime calls (launches, syncs)
            cpu[e.key] = (e.self_cpu_time_total / 1e3 / steps, e.count // steps)
    return row, kernels, cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-config")
    ap.add_argument("--b", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: the code path only (--model smoke)")
    args = ap.parse_args()
    out = os.environ.get("OUT", ".")
    os.makedirs(out, exist_ok=True)
    res, lines = {}, []
    for method in ("hf", "hf_lsce"):
        row, k, cpu = profiled(args.model, method, args.b, args.steps, os.path.join("/tmp", "profile_trainer_" + method),
                          args.device)
        res[method] = {"row": row, "kernels": k, "cpu": cpu}
        total = sum(t for t, _ in k.values())
        runtime = {n: cpu[n] for n in cpu if n.startswith("cuda")}
        lines.append(f"{method}: step {row['step_s'] * 1e3:.1f} ms (profiled), CUDA kernels {total:.1f} ms/step, "
                     f"{sum(c for _, c in k.values())} kernels/step, host self time "
                     f"{sum(t for t, _ in cpu.values()):.1f} ms/step in {sum(c for _, c in cpu.values())} events, "
                     f"tokens/s {row['tokens_per_s']:,.0f}")
        lines.append("  runtime calls per step: " + ", ".join(f"{n} {c} ({t:.1f} ms)" for n, (t, c) in
                                                            sorted(runtime.items(), key=lambda x: -x[1][0])[:8]))
        print(lines[-1], flush=True)
        with open(os.path.join(out, f"profile_trainer_step_{method}.json"), "w") as f:  # kept if a later run dies
            json.dump(res[method], f, default=str)
    for kind, title in (("kernels", "kernels that differ most, ms/step (launches/step)"),
                        ("cpu", "host ops that differ most, self ms/step (calls/step)")):
        hf, ours = res["hf"][kind], res["hf_lsce"][kind]
        names = sorted(set(hf) | set(ours), key=lambda n: -abs(ours.get(n, (0, 0))[0] - hf.get(n, (0, 0))[0]))
        lines.append(f"{title}: hf | hf_lsce")
        for n in names[:30]:
            a, b = hf.get(n, (0, 0)), ours.get(n, (0, 0))
            lines.append(f"  {a[0]:7.2f} ({a[1]:4d}) | {b[0]:7.2f} ({b[1]:4d})  {n[:110]}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(out, "profile_trainer_step.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "profile_trainer_step.json"), "w") as f:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        json.dump({"device": device, "model": args.model, "b": args.b, **res}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
