"""Real inputs for the loss: capture them from real checkpoints, measure their softmax; the generator fitted to them.

    python benchmarks/real_inputs.py capture --model gemma-3-270m --tokens 8192 --out .gpu/gemma_h.pt
    python benchmarks/real_inputs.py analyze --model gemma-3-270m --tokens 2048 --json benchmarks/results/real_softmax.json

``capture`` runs a real checkpoint (installed by name, see hf_lsce.checkpoints) over real instruction text
(the Alpaca-style records of ../shared/data, else the installed TriviaQA/SciQ/OpenBookQA rendered as
instructions) and saves the last hidden states (after the final norm: what the LM head sees), the next-token
targets, and where the head comes from. ``analyze`` measures what makes tiles of the softmax gradient
skippable: for tile shapes and thresholds eps, the fraction of (rows x vocabulary) tiles whose every entry of
|p - onehot(y)| is below eps, in the vocabulary's own order and sorted by mean logit; plus the entropy, the
top-1 and target probabilities. :func:`realistic_batch` is a synthetic generator for other shapes whose
parameters were fitted to those statistics (a random search, then a local refinement; the fit is stored in
``results/real_softmax.json``, and the code that made it in commit 41062fb).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.environ.get("HF_LSCE_SHARED_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data"))
TILES = [(128, 256), (64, 128), (16, 128)]
EPS = [2.0 ** -12, 2.0 ** -16, 2.0 ** -20]


# ------------------------------------------------------------------------------------------------ capture
def _texts(n_tokens: int, tok) -> list[str]:
    sys.path.insert(0, ROOT)
    from hf_lsce.data import load_instruction_records

    path = os.path.join(SHARED, "alpaca", "alpaca_en_demo.json")
    recs = load_instruction_records(path if os.path.exists(path) else "trivia_qa,sciq,openbookqa")
    out, total = [], 0
    for r in recs:
        text = r["prompt"] + r["completion"]
        out.append(text)
        total += len(tok(text)["input_ids"])
        if total >= n_tokens:
            break
    return out


@torch.no_grad()
def capture(model_name: str, n_tokens: int, seq: int = 512, device: str = "cpu"):
    """(hidden (N, D) fp32, targets (N,), head weight (V, D) fp32) of ``n_tokens`` real tokens."""
    sys.path.insert(0, ROOT)
    from hf_lsce.checkpoints import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(model_name, dtype="fp32", device=device)
    model.eval()
    ids = []
    for t in _texts(n_tokens + 64, tok):
        ids += tok(t)["input_ids"]
    ids = torch.tensor(ids[: n_tokens + n_tokens // seq + 1])
    hs, ys = [], []
    for s in range(0, n_tokens, seq):
        chunk = ids[s: s + seq + 1]
        if len(chunk) < 2:
            break
        out = model.model(input_ids=chunk[None, :-1].to(device))
        hs.append(out.last_hidden_state[0].float().cpu())
        ys.append(chunk[1:])
    h, y = torch.cat(hs)[:n_tokens], torch.cat(ys)[:n_tokens]
    return h, y, model.get_output_embeddings().weight.detach().float().cpu()


# ------------------------------------------------------------------------------------------------ analyze
@torch.no_grad()
def softmax_statistics(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, tiles=TILES, eps=EPS, chunk: int = 256,
                       softcap: float | None = None) -> dict:
    """Skippable-tile fractions (vocabulary order and sorted by mean logit), entropy, top-1 and target p."""
    n, v = h.shape[0], w.shape[0]
    mean_logit = (h.mean(0) @ w.T)  # (V,): the mean over tokens of z_v is one matrix-vector product
    order = torch.argsort(mean_logit, descending=True)
    results = {f"{tn}x{tv}": {"natural": {}, "sorted": {}} for tn, tv in tiles}
    # per-row tile maxima of |p - onehot| for every tile width, both orders; then max over row groups
    maxima = {(o, tv): [] for o in ("natural", "sorted") for _, tv in tiles}
    ent, top1, ptgt = [], [], []
    for s in range(0, n, chunk):
        z = h[s: s + chunk] @ w.T
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        lp = torch.log_softmax(z, -1)
        p = lp.exp()
        ent.append(-(p * lp).sum(-1))
        top1.append(p.max(-1).values)
        yy = y[s: s + chunk]
        ptgt.append(p.gather(1, yy[:, None])[:, 0])
        g = p.clone()
        g.scatter_(1, yy[:, None], (p.gather(1, yy[:, None]) - 1.0).abs())
        for o, gg in (("natural", g), ("sorted", g[:, order])):
            for _, tv in tiles:
                pad = (-v) % tv
                gp = torch.nn.functional.pad(gg, (0, pad))
                maxima[(o, tv)].append(gp.view(gp.shape[0], -1, tv).amax(-1))
    for (o, tv), parts in maxima.items():
        rowmax = torch.cat(parts)  # (N, V / tv)
        for tn, tv2 in tiles:
            if tv2 != tv:
                continue
            m = rowmax[: (n // tn) * tn].view(n // tn, tn, -1).amax(1)
            results[f"{tn}x{tv}"][o] = {f"2^{int(math.log2(e))}": float((m < e).float().mean()) for e in eps}
    ent, top1, ptgt = torch.cat(ent), torch.cat(top1), torch.cat(ptgt)
    return {"tokens": n, "vocab": v, "hidden": h.shape[1], "skippable_tiles": results,
            "entropy_mean": float(ent.mean()), "entropy_median": float(ent.median()),
            "top1_mean": float(top1.mean()), "top1_median": float(top1.median()),
            "target_p_mean": float(ptgt.mean()), "target_p_median": float(ptgt.median()),
            "hidden_rms": float(h.pow(2).mean(-1).sqrt().mean()), "logit_std": float((h[:64] @ w.T).std())}


# ------------------------------------------------------------------------------------------------ generator
def realistic_batch(n: int, d: int, v: int, *, prior: float = 1.5, zipf: float = 1.0, peak: float = 10.0,
                    candidates: int = 6, noise: float = 1.0, shuffle: float = 0.3, seed: int = 0,
                    dtype=torch.bfloat16, device="cpu"):
    """A synthetic (hidden, weight, targets) batch whose softmax is shaped like a trained LM's.

    Logits ``z = h @ W^T`` are built from three parts, each realised exactly through the two matrices: a prior
    shared by every row, ``prior * f_v`` with ``f_v = -log(1 + rank_v)`` (0 for the most frequent token; tokens
    likely everywhere: what sorting the vocabulary by mean logit exploits; targets and candidates are drawn from a
    Zipf distribution of exponent ``zipf`` over the same ranks); per row a
    few ``candidates`` (the target and others drawn by frequency) lifted by up to ``peak``; and Gaussian noise of
    standard deviation ``noise``. W's first column carries ``f``, the rest are random rows ~ N(0, I / (D - 1)),
    nearly orthogonal, so a row of h pointing at a token's row lifts that token's logit alone. ``shuffle`` is the
    fraction of vocabulary ids whose frequency rank is shuffled (tokenizers number frequent tokens first, but not
    perfectly). Targets follow the frequencies. The parameters are fitted to real checkpoints by ``fit``.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    f32 = dict(dtype=torch.float32, device=dev)
    rank = torch.arange(v, **f32)
    k = int(shuffle * v)
    if k:
        idx = torch.randperm(v, generator=g, device=dev)[:k]
        rank[idx] = rank[idx[torch.randperm(k, generator=g, device=dev)]]
    logf = -zipf * torch.log1p(rank)
    freq = torch.softmax(logf, 0)
    f = -torch.log1p(rank)  # the prior's shape: 0 for the most frequent token, about -12.5 for the rarest of 262K
    r = torch.randn(v, d - 1, generator=g, **f32) / math.sqrt(d - 1)
    w = torch.cat([f[:, None], r], 1)
    y = torch.multinomial(freq, n, replacement=True, generator=g)
    extra = max(int(candidates) - 1, 0)
    others = (torch.multinomial(freq, n * extra, replacement=True, generator=g).view(n, extra) if extra
              else torch.zeros(n, 0, dtype=torch.long, device=dev))
    lifts = peak * (0.3 + 0.7 * torch.rand(n, others.shape[1], generator=g, **f32))
    unit = r / r.pow(2).sum(1, keepdim=True)  # <unit_v, r_v> = 1
    ctx = peak * unit[y]
    for j in range(others.shape[1]):  # one candidate at a time: no (N, candidates, D) temporary
        ctx += lifts[:, j, None] * unit[others[:, j]]
    ctx += noise * torch.randn(n, d - 1, generator=g, **f32)  # <noise, r_v> ~ N(0, noise^2)
    h = torch.cat([torch.full((n, 1), prior, **f32), ctx], 1)
    return h.to(dtype), w.to(dtype), y


def fitted_params(path: str | None = None, model: str = "gemma-3-270m") -> dict:
    """The generator's parameters fitted to ``model``'s measured softmax (``fit``), from the results file."""
    path = path or os.path.join(ROOT, "benchmarks", "results", "real_softmax.json")
    with open(path) as f:
        data = json.load(f)
    if "generator_fit" not in data.get(model, {}):
        raise KeyError(f"no fitted generator for {model} in {path} (the fit's code: real_inputs.py at commit 41062fb)")
    return data[model]["generator_fit"]["params"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--model", default="gemma-3-270m")
    c.add_argument("--tokens", type=int, default=8192)
    c.add_argument("--out", required=True)
    c.add_argument("--with-head", action="store_true", help="also store the LM head's weight (bf16)")
    a = sub.add_parser("analyze")
    a.add_argument("--model", default="gemma-3-270m")
    a.add_argument("--tokens", type=int, default=2048)
    a.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cmd == "capture":
        h, y, w = capture(args.model, args.tokens, device="cuda" if torch.cuda.is_available() else "cpu")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        data = {"model": args.model, "hidden": h.to(torch.bfloat16), "targets": y}
        if args.with_head:
            data["weight"] = w.to(torch.bfloat16)
        torch.save(data, args.out)
        print(f"captured {h.shape[0]} tokens of {args.model} (D = {h.shape[1]}) to {args.out}")
    else:
        t0 = time.time()
        h, y, w = capture(args.model, args.tokens)
        stats = softmax_statistics(h, w, y)
        stats.update(model=args.model, seconds=round(time.time() - t0, 1))
        print(json.dumps(stats, indent=1))
        if args.json:
            old = json.load(open(args.json)) if os.path.exists(args.json) else {}
            if "generator_fit" in old.get(args.model, {}):  # a new measurement keeps the stored fit
                stats["generator_fit"] = old[args.model]["generator_fit"]
            old[args.model] = stats
            with open(args.json, "w") as fh:
                json.dump(old, fh, indent=1)


if __name__ == "__main__":
    main()
