"""How confident can an LM head be? The entropy lower bound behind "smoothing helps less at large V".

The head computes logits ``z = W h`` with ``W`` of shape (V, D). Softmax ignores a common shift of
the logits, so only their centred part ``z - mean(z)`` matters, and its norm is bounded:

    ||z - mean(z)||_2  <=  ||z||_2  <=  ||W||_2 * ||h||_2  =  ||W||_2 * RMS(h) * sqrt(D)  =  rho * sqrt(D)

with ``rho = ||W||_2 * max RMS(h)``: the logit scale per unit of hidden size (the final RMSNorm fixes
RMS(h) up to its weight, so rho is a property of the head and the norm, and ``sqrt(D)`` is what a wider
model adds). The lowest entropy any logit vector with centred norm ``R = rho sqrt(D)`` can have is
reached by one logit standing ``a = R sqrt(V / (V - 1))`` above V - 1 equal ones:

    H_min(V, R) = log(1 + q) + a q / (1 + q),     q = (V - 1) exp(-a)

(``tests/test_theory.py`` checks it is the minimum by direct numerical minimisation for small V).
This is the bound of Theorem 4.2 (Eq. 14) of "Calibrated Language Models and How to Find Them with
Label Smoothing" (Lu, Huang and Zeng, 2025), with rho taken from ``||h||`` (at most the paper's
entry-wise rho: the same bound or a higher one); ``tests/test_theory.py`` holds it equal to Eq. 14 and
``docs/theory.md`` says where this package departs from the paper's remarks. The *normalised entropy
gap* ``1 - H_min / log V`` is the share of the maximum entropy ``log V`` the head is able to remove:
near 0 the head cannot be confident at all, near 1 it can be certain. It grows with D and shrinks with
V (the paper's Figure 4; ``plot_entropy_gap`` draws it).

Label smoothing with factor b pulls each prediction towards the smoothed target, whose entropy is
``H_ls(b, V)``. It can only act if the head could otherwise become *more* confident than that target
(``H_min < H_ls``); when the bound already sits above ``H_ls`` the norm constraint, not the loss,
limits confidence, and smoothing changes little (the Remark after the theorem). ``diagnose`` says
which case a model is in.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value


def _check_rho(rho) -> float:
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not math.isfinite(rho) or rho < 0:
        raise ValueError(f"rho must be a finite number >= 0 (the logit scale per unit of hidden size), got {rho!r}.")
    return float(rho)


def _one_vs_rest_entropy(v: int, a: float) -> float:
    """Entropy of softmax over V logits: one standing ``a`` above V - 1 equal ones (V >= 2)."""
    log_q = math.log(v - 1) - a
    if log_q > 700:  # a ~ 0: q overflows; the distribution is uniform to machine precision
        return math.log(v)
    q = math.exp(log_q)
    return math.log1p(q) + a * q / (1.0 + q)


def min_entropy(vocab_size: int, logit_norm: float) -> float:
    """Lowest entropy (nats) of softmax(z) over logits whose centred 2-norm is at most ``logit_norm``."""
    v = _check_positive_int("vocab_size", vocab_size)
    r = _check_rho(logit_norm)
    if v == 1:
        return 0.0
    return _one_vs_rest_entropy(v, r * math.sqrt(v / (v - 1)))  # the gap whose centred norm is r


def min_entropy_capped(vocab_size: int, softcap: float) -> float:
    """Lowest entropy when every logit lies in [-softcap, softcap] (soft-capped heads, e.g. Gemma2)."""
    v = _check_positive_int("vocab_size", vocab_size)
    cap = _check_rho(softcap)
    if v == 1:
        return 0.0
    return _one_vs_rest_entropy(v, 2.0 * cap)  # top logit at +cap, the others at -cap


def entropy_lower_bound(hidden_size: int, vocab_size: int, rho: float) -> float:
    """The entropy lower bound (nats) of a D x V head whose logit scale per unit of hidden size is rho.

    ``H(softmax(W h)) >= H_min(V, rho * sqrt(D))`` for every h, where ``rho = ||W||_2 * max RMS(h)``.
    """
    d = _check_positive_int("hidden_size", hidden_size)
    return min_entropy(vocab_size, _check_rho(rho) * math.sqrt(d))


def normalized_entropy_gap(hidden_size: int, vocab_size: int, rho: float) -> float:
    """``1 - H_min / log V``: the share of the maximum entropy the head is able to remove (0..1)."""
    v = _check_positive_int("vocab_size", vocab_size)
    if v == 1:
        return 1.0
    return 1.0 - entropy_lower_bound(hidden_size, v, rho) / math.log(v)


def smoothed_target_entropy(label_smoothing: float, vocab_size: int) -> float:
    """Entropy (nats) of the label-smoothed target: 1 - b + b/V on the label, b/V elsewhere."""
    v = _check_positive_int("vocab_size", vocab_size)
    b = label_smoothing
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b <= 1:
        raise ValueError(f"label_smoothing must be in [0, 1], got {b!r}.")
    if b == 0 or v == 1:
        return 0.0
    p_top, p_rest = 1 - b + b / v, b / v
    return -p_top * math.log(p_top) - (v - 1) * p_rest * math.log(p_rest)


@dataclass
class Diagnosis:
    """What ``diagnose`` found; ``verdict`` says it in words."""

    hidden_size: int
    vocab_size: int
    rho: float
    rho_source: str
    label_smoothing: float
    entropy_bound: float
    normalized_gap: float
    smoothed_target_entropy: float
    softcap: float | None = None
    softcap_bound: float | None = None
    observed: dict = field(default_factory=dict)
    verdict: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"hidden size D = {self.hidden_size}, vocabulary V = {self.vocab_size} (log V = {math.log(self.vocab_size):.3f} nats)",
            f"rho = {self.rho:.4g} ({self.rho_source}); logit-norm bound rho*sqrt(D) = {self.rho * math.sqrt(self.hidden_size):.4g}",
            f"entropy lower bound H_min = {self.entropy_bound:.4g} nats; normalised entropy gap = {self.normalized_gap:.4f}",
        ]
        if self.softcap is not None:
            lines.append(f"soft-cap {self.softcap:g}: entropy >= {self.softcap_bound:.4g} nats from the cap alone")
        lines.append(f"entropy of the smoothed target at b = {self.label_smoothing:g}: {self.smoothed_target_entropy:.4g} nats")
        for k, v in self.observed.items():
            lines.append(f"measured {k.replace('_', ' ')}: {v:.4g}" if isinstance(v, float) else f"measured {k.replace('_', ' ')}: {v}")
        lines.append(self.verdict)
        return "\n".join(lines)


def _verdict(bound: float, target: float, b: float, observed_gap_bound: float | None) -> str:
    if b == 0:
        return "No smoothing asked for (b = 0): nothing to compare."
    if bound >= target:
        return (f"Label smoothing at b = {b:g} can be expected to change little: the head cannot become more confident "
                f"than the smoothed target anyway (its entropy bound {bound:.3g} >= {target:.3g} nats), so the logit "
                "norm, not the loss, limits confidence. Calibrate after training instead (temperature scaling or ATS).")
    msg = (f"Label smoothing at b = {b:g} can act: the head is able to reach entropies below the smoothed target's "
           f"({bound:.3g} < {target:.3g} nats), i.e. to become more confident than smoothing allows, so smoothing "
           "is what stops it.")
    if observed_gap_bound is not None and observed_gap_bound >= target:
        msg += (f" On the sample text, though, the logits it produced could not go below {observed_gap_bound:.3g} nats: "
                "at its current scale smoothing would hardly bind; expect a small effect unless training grows the logits.")
    return msg


def spectral_norm(weight: torch.Tensor, iters: int = 100, tol: float = 1e-6) -> float:
    """Largest singular value of a (V, D) matrix by power iteration on W^T W (no V x V or SVD)."""
    w = weight.detach().float()
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(w.shape[1], generator=g).to(w.device)
    x /= x.norm()
    sigma = 0.0
    for _ in range(iters):
        y = w.T @ (w @ x)
        new = float(y.norm()) ** 0.5
        x = y / y.norm()
        if abs(new - sigma) <= tol * new:
            return new
        sigma = new
    return sigma


DEFAULT_SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Water boils at one hundred degrees Celsius at sea level. "
    "In 1969, Apollo 11 landed on the Moon, and Neil Armstrong became the first person to walk on its surface. "
    "To compute the area of a circle, multiply pi by the square of the radius. "
    "Question: What is the capital of France? Answer: Paris.")


@torch.no_grad()
def measure_rho(model, tokenizer, texts: list[str] | None = None, max_length: int = 512) -> dict:
    """rho and friends from a model's weights and its final hidden states on sample text.

    Returns ``rho`` (= ||W||_2 * max RMS(h), the guaranteed bound), ``rho_observed`` (= max centred
    logit norm / sqrt(D), what the text reached), the spectral norm, max RMS(h), and the mean and
    minimum entropy of the predictions.
    """
    texts = texts or [DEFAULT_SAMPLE_TEXT]
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head): nothing to diagnose.")
    w = head.weight
    d = w.shape[1]
    sigma = spectral_norm(w)
    max_rms = max_norm = 0.0
    ent = []
    dev = w.device
    for t in texts:
        enc = tokenizer(t, return_tensors="pt", truncation=True, max_length=max_length).to(dev)
        out = model(**enc, output_hidden_states=True)
        h = out.hidden_states[-1][0].float()  # (T, D), after the final norm
        z = out.logits[0].float()
        max_rms = max(max_rms, float(h.pow(2).mean(-1).sqrt().max()))
        max_norm = max(max_norm, float((z - z.mean(-1, keepdim=True)).norm(dim=-1).max()))
        lp = torch.log_softmax(z, -1)
        ent.append(-(lp.exp() * lp).sum(-1))
    ent = torch.cat(ent)
    return dict(rho=sigma * max_rms, rho_observed=max_norm / math.sqrt(d), spectral_norm=sigma, max_rms_hidden=max_rms,
                mean_entropy=float(ent.mean()), min_entropy=float(ent.min()), tokens=int(ent.numel()))


def rho_at_init(config) -> float:
    """rho of a freshly initialised head: ||W||_2 ~ std (sqrt V + sqrt D) for N(0, std^2) weights, RMS(h) = 1."""
    std = float(getattr(config, "initializer_range", 0.02) or 0.02)
    return std * (math.sqrt(config.vocab_size) + math.sqrt(config.hidden_size))


def diagnose(hidden_size: int, vocab_size: int, rho: float, label_smoothing: float = 0.1, *,
             rho_source: str = "given", softcap: float | None = None, observed: dict | None = None) -> Diagnosis:
    """The bound, the normalised gap and the smoothing verdict for a head of this shape and scale."""
    bound = entropy_lower_bound(hidden_size, vocab_size, rho)
    cap_bound = min_entropy_capped(vocab_size, softcap) if softcap else None
    eff = max(bound, cap_bound) if cap_bound is not None else bound
    target = smoothed_target_entropy(label_smoothing, vocab_size)
    observed = dict(observed or {})
    obs_bound = None
    if "rho_observed" in observed:
        obs_bound = entropy_lower_bound(hidden_size, vocab_size, observed["rho_observed"])
        observed["entropy_bound_at_observed_rho"] = obs_bound
    return Diagnosis(hidden_size, vocab_size, float(rho), rho_source, float(label_smoothing), eff,
                     1.0 - eff / math.log(vocab_size) if vocab_size > 1 else 1.0, target, softcap, cap_bound,
                     observed, _verdict(eff, target, label_smoothing, obs_bound))


def plot_entropy_gap(path: str | None = None, rho: float = 0.25, vocab_sizes=(32_000, 128_256, 256_000),
                     hidden_sizes=None, models: dict | None = None):
    """The paper's Figure 4: normalised entropy gap against hidden size, one curve per vocabulary size.

    ``models`` maps a label to (D, V) and marks real model shapes on their curve.
    """
    from matplotlib.figure import Figure  # no pyplot: never switches the user's backend

    hidden_sizes = hidden_sizes or [2 ** (k / 16) for k in range(128, 225)]  # 256 .. 16384
    models = models if models is not None else {
        "Mistral-7B": (4096, 32_000), "Llama-3.2-1B": (2048, 128_256), "Llama-3-8B": (4096, 128_256),
        "Gemma-2B": (2048, 256_000), "Gemma2-2B": (2304, 256_000), "Gemma-7B": (3072, 256_000)}
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    colours = {}
    for v in vocab_sizes:
        gaps = [normalized_entropy_gap(max(1, round(d)), v, rho) for d in hidden_sizes]
        (line,) = ax.plot(hidden_sizes, gaps, label=f"V = {v // 1000}K")
        colours[v] = line.get_color()
    for i, (name, (d, v)) in enumerate(models.items()):
        gap = normalized_entropy_gap(d, v, rho)
        ax.scatter([d], [gap], color=colours.get(v, "k"), zorder=3, s=18)
        ax.annotate(name, (d, gap), textcoords="offset points", xytext=(-75, 8 + 10 * (i % 6)), fontsize=7,
                    arrowprops=dict(arrowstyle="-", lw=0.5, color="0.5"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("hidden size D")
    ax.set_ylabel("normalised entropy gap  1 - H_min / log V")
    ax.set_title(f"How confident can the head become? (rho = {rho:g})")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=130)
    return fig
