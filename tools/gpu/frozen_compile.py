"""A frozen head (LoRA) under torch.compile(fullgraph=True) and replayed from a CUDA graph: dh against the eager op
(the fused pass by vocabulary columns, one chunk and several, memory='low'), no host synchronisation."""
import json, torch
import hf_lsce.ops.fused_pass as fp
from hf_lsce import linear_cross_entropy

g = torch.Generator(device="cuda").manual_seed(2)
n, d, v = 4096, 640, 65536
w = (torch.randn(v, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
h = (torch.randn(n, d, device="cuda", generator=g) * 3).bfloat16()
y = torch.randint(0, v, (n,), device="cuda", generator=g)
for case in ("one chunk", "1 GiB chunks forced to 64 MiB", "memory=low"):
    saved = fp.FUSED_CHUNK_BYTES, fp.EVERY_ROW_EXTRA_BYTES
    if case.startswith("1 GiB"):
        fp.FUSED_CHUNK_BYTES, fp.EVERY_ROW_EXTRA_BYTES = 64 << 20, -(1 << 40)
    mem = "low" if case == "memory=low" else "auto"
    hh = h.clone().requires_grad_()

    def op(a, b, t):
        return linear_cross_entropy(a, b, t, label_smoothing=0.1, memory=mem)
    op(hh, w, y).backward()
    eager = hh.grad.clone()
    torch._dynamo.reset()
    compiled = torch.compile(op, fullgraph=True)

    def body():
        hh.grad = None
        compiled(hh, w, y).backward()
    body()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        body()
        sync_free = True
    except RuntimeError as e:
        sync_free = str(e)[:160]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    comp = (hh.grad.double() - eager.double()).norm().item() / eager.double().norm().item()
    gh = torch.zeros_like(h)

    def captured():
        body()
        gh.copy_(hh.grad)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()
    gh.zero_()
    graph.replay()
    torch.cuda.synchronize()
    rep = (gh.double() - eager.double()).norm().item() / eager.double().norm().item()
    print(json.dumps(dict(case=case, sync_free=sync_free, compiled_vs_eager=comp, graph_replay_vs_eager=rep)))
    fp.FUSED_CHUNK_BYTES, fp.EVERY_ROW_EXTRA_BYTES = saved
    del graph
