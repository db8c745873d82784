"""The op and the patched forward under torch.compile(fullgraph=True) and CUDA graphs, on a GPU: correctness against
eager and against fp32 / HF's own loss, host synchronisations, and times. Prints tables, writes JSON.

    python benchmarks/check_compile_gpu.py --out-dir bench_out          # H100: about 3 minutes

1. The op alone (bf16, peaked synthetic inputs) at the Gemma-3-270m and Llama-3-8B head shapes: fwd+bwd of the eager
   op, of ``torch.compile(fullgraph=True)`` (inductor) around it, and of that compiled function captured in a CUDA
   graph and replayed; dh / dW errors of each against fp32 logits; host synchronisations of a compiled call
   (``torch.cuda.set_sync_debug_mode``).
2. A patched model (SmolLM2-135M's configuration, random weights, bf16) under ``torch.compile(model,
   fullgraph=True)``: its loss against HF's smoothed loss of the unpatched model's logits, its gradients against the
   eager patched model, fused calls counted per compiled step, and the train step (fwd+bwd+AdamW) eager, compiled,
   and compiled with ``mode="reduce-overhead"`` (CUDA graphs), against stock HF eager and compiled.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hf_lsce import linear_cross_entropy  # noqa: E402

B = 0.1
SHAPES = {"gemma3-270m": (8192, 640, 262144), "llama3-8b": (8192, 4096, 128256)}


def peaked_inputs(n, d, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(v, d, device="cuda", generator=g) / d ** 0.5
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    h = torch.randn(n, d, device="cuda", generator=g) * 0.5 + 8.0 * w[y] / w[y].norm(dim=-1, keepdim=True)
    return h.bfloat16(), w.bfloat16(), y


def fp32_reference(h, w, y):
    hr, wr = h.float().requires_grad_(), w.float().requires_grad_()
    loss = torch.zeros((), device="cuda")
    for i in range(0, h.shape[0], 1024):  # chunks: the fp32 logits of 8192 x 262144 would be 8 GiB
        z = hr[i:i + 1024] @ wr.T
        loss = loss + F.cross_entropy(z, y[i:i + 1024], label_smoothing=B, reduction="sum")
    (loss / h.shape[0]).backward()
    return hr.grad, wr.grad


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def host_syncs(fn):
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(m.message) for m in log)


def op_rows(name):
    n, d, v = SHAPES[name]
    h, w, y = peaked_inputs(n, d, v)
    ref_dh, ref_dw = fp32_reference(h, w, y)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()

    def step(f):
        def run():
            hh.grad = ww.grad = None
            f(hh, ww, y).backward()
        return run

    def op(a, b, t):
        return linear_cross_entropy(a, b, t, label_smoothing=B)

    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True)
    rows = []
    for method, f in (("eager", op), ("compiled (fullgraph)", compiled)):
        run = step(f)
        ms = timed(run)
        syncs = host_syncs(run)
        rows.append(dict(shape=name, method=method, ms=ms, dh_err=rel(hh.grad, ref_dh), dw_err=rel(ww.grad, ref_dw),
                         host_syncs=syncs))
    # The compiled call captured in a CUDA graph (static inputs and gradient buffers), then replayed.
    gh, gw = torch.zeros_like(h), torch.zeros_like(w)

    def graph_body():
        hh.grad = ww.grad = None
        compiled(hh, ww, y).backward()
        gh.copy_(hh.grad)
        gw.copy_(ww.grad)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            graph_body()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_body()
    gh.zero_()
    gw.zero_()
    ms = timed(graph.replay)
    rows.append(dict(shape=name, method="compiled, CUDA graph replay", ms=ms, dh_err=rel(gh, ref_dh),
                     dw_err=rel(gw, ref_dw), host_syncs=host_syncs(graph.replay)))
    del graph
    return rows


def smollm2(device="cuda"):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                               tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.config.use_cache = False
    return model.train()


def model_rows(batch, seq, steps, only_checks=False):
    from hf_lsce.patching import ENGAGEMENT, apply_lsce_patch

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 49152, (batch, seq), device="cuda", generator=g)
    labels = ids.clone()
    labels[:, : seq // 4] = -100
    items = (labels[:, 1:] != -100).sum()
    rows, checks = [], {}

    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]

    def stock_grads(compile_it):
        """HF's smoothed loss on the unpatched model's logits, and its gradients (eager, or compiled: the baseline
        for how much compiling the bf16 backbone alone changes the gradients)."""
        torch._dynamo.reset()
        stock = smollm2()
        fwd = torch.compile(stock) if compile_it else stock
        for _ in range(2 if compile_it else 1):
            stock.zero_grad(set_to_none=True)
            logits = fwd(input_ids=ids).logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), label_smoothing=B,
                                   reduction="sum") / items
            loss.backward()
        return loss.detach(), [p.grad.float().clone() for p in stock.parameters()]

    hf_loss, hf_eager_grads = stock_grads(False)
    _, hf_compiled_grads = stock_grads(True)
    checks["stock_grad_err_compiled_vs_eager"] = max(rel(p, q) for p, q in zip(hf_compiled_grads, hf_eager_grads))
    del hf_compiled_grads

    eager = smollm2()
    apply_lsce_patch(eager, label_smoothing=B)
    out = eager(input_ids=ids, labels=labels, num_items_in_batch=items)
    out.loss.backward()
    eager_grads = [p.grad.float().clone() for p in eager.parameters()]
    eager_loss = out.loss.item()

    patched = smollm2()
    apply_lsce_patch(patched, label_smoothing=B)
    torch._dynamo.reset()
    compiled = torch.compile(patched, fullgraph=True)
    before = ENGAGEMENT.fused_calls
    for _ in range(2):
        patched.zero_grad(set_to_none=True)
        out = compiled(input_ids=ids, labels=labels, num_items_in_batch=items)
        out.loss.backward()
    checks.update(hf_loss=hf_loss.item(), eager_loss=eager_loss, compiled_loss=out.loss.item(),
                  logits_returned=out.logits is not None, fused_calls_per_2_steps=ENGAGEMENT.fused_calls - before,
                  grad_err_vs_eager=max(rel(p.grad, q) for p, q in zip(patched.parameters(), eager_grads)),
                  eager_grad_err_vs_stock_eager=max(rel(p, q) for p, q in zip(eager_grads, hf_eager_grads)))
    del eager, patched, compiled
    torch._dynamo.reset()

    def bench(method, model, mode=None):
        if model is None:
            model = smollm2()
        if method.startswith("hf_lsce"):
            apply_lsce_patch(model, label_smoothing=B)
        fwd = model if mode is False else torch.compile(model, fullgraph=method.startswith("hf_lsce"), mode=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        stock_loss = not method.startswith("hf_lsce")

        def step():
            if stock_loss:  # HF's own smoothing: the Trainer's label smoother on the logits
                lg = fwd(input_ids=ids).logits
                loss = F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), shifted.reshape(-1),
                                       label_smoothing=B, reduction="sum") / items
            else:
                loss = fwd(input_ids=ids, labels=labels, num_items_in_batch=items).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / steps
        syncs = host_syncs(step)
        row = dict(model="smollm2-135m-config", method=method, batch=batch, seq=seq, step_ms=dt * 1e3,
                   tokens_per_s=batch * seq / dt, peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                   host_syncs_per_step=syncs)
        del fwd, opt, model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        return row

    for method, mode in () if only_checks else (("hf eager", False), ("hf compiled", None), ("hf_lsce eager", False),
                         ("hf_lsce compiled (fullgraph)", None), ("hf compiled reduce-overhead", "reduce-overhead"),
                         ("hf_lsce compiled reduce-overhead", "reduce-overhead")):
        try:
            rows.append(bench(method, None, mode))
        except Exception as e:  # noqa: BLE001 - reported in the table
            rows.append(dict(model="smollm2-135m-config", method=method, error=f"{type(e).__name__}: {str(e)[:300]}"))
        print(json.dumps(rows[-1]), flush=True)
    return rows, checks


def report(result) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, triton {result['triton']}", "",
             "| head shape | method | fwd+bwd ms | dh err | dW err | host syncs |", "|---|---|---|---|---|---|"]
    for r in result["op"]:
        lines.append(f"| {r['shape']} | {r['method']} | {r['ms']:.2f} | {r['dh_err']:.1e} | {r['dw_err']:.1e} | "
                     f"{r['host_syncs']} |")
    lines += ["", f"checks: {json.dumps(result['checks'])}", "",
              "| model | method | batch x seq | step ms | tokens/s | peak GiB | host syncs / step |",
              "|---|---|---|---|---|---|---|"]
    for r in result["model"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['error']} |||||")
        else:
            lines.append(f"| {r['model']} | {r['method']} | {r['batch']} x {r['seq']} | {r['step_ms']:.1f} | "
                         f"{r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} | {r['host_syncs_per_step']} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--shapes", default="gemma3-270m,llama3-8b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--model-methods", default="all", help="'none': only the correctness checks of the model part; 'skip': no model part")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, op=[], model=[], checks={})
    import triton

    result["triton"] = triton.__version__
    for name in filter(None, args.shapes.split(",")):
        for r in op_rows(name):
            result["op"].append(r)
            print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    if args.model_methods != "skip":
        result["model"], result["checks"] = model_rows(args.batch, args.seq, args.steps,
                                                      only_checks=args.model_methods == "none")
    md = report(result)
    print(md)
    with open(os.path.join(args.out_dir, "check_compile_gpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out_dir, "check_compile_gpu.md"), "w") as f:
        f.write(md + "\n")


if __name__ == "__main__":
    main()
