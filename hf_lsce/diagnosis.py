"""Will label smoothing help this model's calibration, and with which b? Measured, not bounded.

Smoothing lowers confidence; it corrects over-confidence and does nothing for under-confidence (it pushes a
calibrated or under-confident model further under). So the answer depends on the model's measured state on
held-out data, which :func:`diagnose_model` measures in three parts:

1. **Token level, on held-out instruction records** (what SFT trains on): next-token accuracy, mean
   confidence, the signed gap (mean confidence minus accuracy), ECE, the share of tokens on which smoothing
   at b binds (top probability above the smoothed target's own, ``1 - b + b/V``), and the logit norms the model
   actually produces with the entropy bound at them (the spectral bound of :mod:`hf_lsce.theory` beside it).
2. **What smoothing would do to those tokens.** The smoothed loss at b is fitted with one temperature:
   ``T*(b) = argmin_T mean_tokens LS_b(z / T, y)``. ``T*(0)`` is the NLL-optimal temperature, so
   ``tau(b) = T*(b) / T*(0)`` is how much softer smoothing at b makes the model than plain SFT would, read off
   the model's own logits (a one-parameter counterfactual: real training can reshape more than a scale).
3. **Task level, on multiple-choice sets where the model is above chance** (ARC-Easy, SciQ, PIQA, BoolQ,
   OpenBookQA; MMLU when the model is above chance on it): accuracy, ECE and the signed gap with its 95%
   interval, and each task rescored with every next-token distribution softened by ``tau(b)``: the ECE the
   model would have (``TaskScores.probs_at``). Tasks at chance are reported but take no part: there ECE only
   measures how far confidence sits from 1/choices.

The state-based counterfactual at b compares the pooled miscalibration of the softened model with the model's own.
The pooled quantity is the absolute signed gap, items-weighted over the above-chance tasks: smooth in the temperature
where binned ECE on a few hundred items jumps from bin to bin, and what smoothing can change (it moves confidence, not
what the model knows); the predicted ECE is reported beside it. Lower by more than ``margin`` (default 0.01) is
``"helps"``, higher by more than it ``"hurts"``, else ``"little-effect"`` (``state_prediction``, and its
``state_suggested_b``: the b of the grid with the lowest predicted value, 0 when none beats the model by the margin).
With no task above chance the tokens stand in, and the result says so.

**Without a probe the diagnosis abstains**: ``prediction`` and ``suggested_b`` are None and ``abstain_reason`` says why.
The counterfactual was not validated: it said "helps" for both installed checkpoints (SmolLM2-135M-Instruct and
Gemma-3-270m), and Table 1's full fine-tunings raised Gemma-3-270m's ECE in 8 of its 12 Alpaca runs (docs/theory.md).
It is reported as the model's state, not as a prediction.

**The probe** (:meth:`ModelDiagnosis.add_probe`, ``hf-lsce diagnose --probe``): the counterfactual above softens every
next-token distribution, and on the single-token answers of MMLU and BoolQ fine-tuning moved something else: the
answer prior (which letter, yes or no, the model leans to), in a direction that differed between models and SFT data
(docs/theory.md). Nothing in the state measured above predicts that direction; two short fine-tunings from the
model's weights on the user's data, at 0 and at b, measure it (``hf_lsce.sweep.run_sweep``). When a probe is added,
its verdict is the prediction (:func:`probe_prediction`), validated against Table 1 on both checkpoints after Alpaca
SFT (docs/theory.md); the counterfactual stays as ``state_prediction``.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass, field

import torch

logger = logging.getLogger(__name__)

DEFAULT_TASKS = "arc_easy,sciq,piqa,boolq,openbookqa"
DEFAULT_RECORDS = "trivia_qa,nq_open"
B_GRID = (0.05, 0.1, 0.2, 0.3)
PREDICTIONS = ("helps", "little-effect", "hurts")
# the probe's SFT steps (of 32 on the GPU budget): the length at which the sweeps' verdicts matched the full
# fine-tunings of Table 1 for both installed checkpoints (docs/theory.md)
PROBE_STEPS = 60
# a task answered from one answer set whose most given answer takes this share of the items "leans": there smoothing
# moved the prior itself in Table 1, either way (docs/theory.md), which no state-based counterfactual predicts
PRIOR_LEAN = 0.8
PROBE_VERDICT = {"better": "helps", "worse": "hurts", "no resolvable change": "little-effect"}
# what the probe costs, measured (docs/theory.md): on an H100 the six probes of benchmarks/results/probe_*_sweep.json
# (60 SFT steps of 32 at b = 0 and b, four tasks of 400 items) took 104-186 s; on 2 CPU cores at the CPU budget, 9 min
PROBE_TIME = "about 2-3 minutes per model on an H100 (104-186 s measured), 9 minutes on 2 CPU cores at the CPU budget"
ABSTAIN_REASON = ("no prediction without a probe: the state-based counterfactual is not validated (it said 'helps' for "
                  "both installed checkpoints, and Table 1's full fine-tunings raised Gemma-3-270m's ECE in 8 of 12 "
                  "runs, docs/theory.md). Measure it: hf-lsce diagnose MODEL --probe (two short fine-tunings at 0 and "
                  f"b from these weights on your data; {PROBE_TIME}) or hf-lsce sweep (a grid of b)")
# the state-based prediction's own caveat (a probe, when added, replaces it)
_COUNTERFACTUAL_CAVEAT = ("a one-temperature counterfactual of the model as it is now: fine-tuning also changes what "
                          "the model knows, and the SFT data and steps change its state (docs/theory.md says where "
                          "this can be wrong)")
_TOPK, _BINS = 256, 256  # logit summary per token: the top-k exactly, the rest as a histogram


# ------------------------------------------------------------------------------------------ token level
def _summarise(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token (rows of fp32 logits z): the top-k logits, and the rest as (bin mean, count) over _BINS bins.
    ``logsumexp(z / T)`` for any T > 0 is then ``logsumexp([top / T, mean / T + log count])`` to within the
    bins' width (the tail holds little of the mass at the temperatures searched)."""
    k = min(_TOPK, z.shape[-1])
    top, idx = torch.topk(z, k, dim=-1)
    rest = z.scatter(-1, idx, float("nan"))
    lo = torch.nan_to_num(rest, nan=float("inf")).amin(-1, keepdim=True)
    hi = torch.nan_to_num(rest, nan=float("-inf")).amax(-1, keepdim=True)
    valid = ~torch.isnan(rest)
    width = (hi - lo).clamp_min(1e-6)
    b = ((rest - lo) / width * _BINS).floor().clamp(0, _BINS - 1)
    b = torch.where(valid, b, torch.zeros_like(b)).long()
    count = torch.zeros(z.shape[0], _BINS).scatter_add_(-1, b, valid.float())
    total = torch.zeros(z.shape[0], _BINS).scatter_add_(-1, b, torch.where(valid, rest, torch.zeros_like(rest)))
    mean = torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))
    return top, mean, count


def _lse_at(top, mean, count, t: float) -> torch.Tensor:
    tail = torch.where(count > 0, mean / t + count.clamp_min(1).log(), torch.full_like(mean, float("-inf")))
    return torch.logsumexp(torch.cat([top / t, tail], -1), -1)


def fitted_temperature(stats: dict, b: float, *, lo: float = 0.2, hi: float = 10.0) -> float:
    """``T*(b) = argmin_T`` of the mean label-smoothed loss of ``logits / T`` over the summarised tokens (a log grid,
    then a finer one around its minimum; 1% resolution)."""
    top, mean, count, zy, zmean = (stats[k] for k in ("top", "tail_mean", "tail_count", "z_label", "z_mean"))

    def loss(t):
        return float((_lse_at(top, mean, count, t) - (1 - b) * zy / t - b * zmean / t).mean())

    grid = torch.logspace(math.log10(lo), math.log10(hi), 61).tolist()
    best = min(grid, key=loss)
    fine = torch.logspace(math.log10(best / 1.07), math.log10(best * 1.07), 15).tolist()
    return min(fine, key=loss)


@torch.no_grad()
def token_statistics(model, tokenizer, records: list[dict], *, max_length: int = 256, n_bins: int = 15,
                     progress: bool = True) -> dict:
    """Next-token predictions on the completions of held-out ``{prompt, completion}`` records: confidences,
    correctness, centred logit norms, entropies, and a per-token logit summary for :func:`fitted_temperature`."""
    from tqdm.auto import tqdm

    if not records:
        raise ValueError("records is empty: the token-level diagnosis needs held-out instruction records")
    dev = next(model.parameters()).device
    conf, correct, norms, ents, tops, means, counts, zys, zms = ([] for _ in range(9))
    for r in tqdm(records, desc="token-level diagnosis", disable=not progress, leave=False):
        p_ids = tokenizer(r["prompt"])["input_ids"]
        ids = tokenizer(r["prompt"] + r["completion"])["input_ids"]
        n = len(ids) - len(p_ids)
        if ids[: len(p_ids)] != p_ids:  # a tokenizer that merges across the seam: the completion's own length
            n = len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"])
        ids = ids[-max_length:]  # long prompts lose their start, never the completion
        n = min(n, len(ids) - 1)
        if n < 1:
            continue
        out = model(input_ids=torch.tensor([ids], device=dev), logits_to_keep=n + 1) \
            if "logits_to_keep" in _params(model) else model(input_ids=torch.tensor([ids], device=dev))
        z = out.logits[0, -(n + 1):-1].float().cpu()
        y = torch.tensor(ids[-n:])
        lse = torch.logsumexp(z, -1)
        zmax, arg = z.max(-1)
        conf.append((zmax - lse).exp())
        correct.append((arg == y).float())
        norms.append((z - z.mean(-1, keepdim=True)).norm(dim=-1))
        lp = z - lse[:, None]
        ents.append(-(lp.exp() * lp).sum(-1))
        t, m, c = _summarise(z)
        tops.append(t), means.append(m), counts.append(c)
        zys.append(z.gather(1, y[:, None])[:, 0]), zms.append(z.mean(-1))
    if not conf:
        raise ValueError("no record left a completion token to score; check the records' prompt/completion fields")
    cat = torch.cat
    return dict(confidence=cat(conf), correct=cat(correct), logit_norm=cat(norms), entropy=cat(ents), top=cat(tops),
                tail_mean=cat(means), tail_count=cat(counts), z_label=cat(zys), z_mean=cat(zms))


def _params(model) -> set:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def token_level(st: dict, b: float, grid, vocab_size: int, *, margin: float = 0.01, n_bins: int = 15):
    """The next-token state of :func:`token_statistics`' output ``st`` and what smoothing at each b of ``grid``
    would do to it: ``(tokens, temperatures, tau)``. ``tokens`` holds accuracy, mean confidence, signed gap, ECE,
    the share of tokens on which smoothing at ``b`` binds, the logit norms, the ECE and signed gap of the tokens
    softened by ``tau(b) = T*(b) / T*(0)`` per b, and ``prediction``: :func:`decide` on their |signed gap| at ``b``."""
    from .calibration import calibration_metrics

    grid = sorted({float(x) for x in grid} | {float(b)})
    temps = {"0": fitted_temperature(st, 0.0)}
    for x in grid:
        temps[_key(x)] = fitted_temperature(st, x)
    tau = {_key(x): temps[_key(x)] / temps["0"] for x in grid}
    res = calibration_metrics(confidences=st["confidence"], correct=st["correct"], n_bins=n_bins)
    p_top = 1 - b + b / vocab_size
    tokens = dict(n=res.n, accuracy=res.accuracy, mean_confidence=res.mean_confidence, signed_gap=res.signed_gap,
                  ece=res.ece, rms=res.rms, mean_entropy=float(st["entropy"].mean()),
                  binding_share=float((st["confidence"] > p_top).float().mean()),
                  max_logit_norm=float(st["logit_norm"].max()), median_logit_norm=float(st["logit_norm"].median()))
    pred_ece, pred_gap = {}, {}
    for x in grid:  # the counterfactual: the tokens with logits / tau(b)
        t = tau[_key(x)]
        c = (st["top"][:, 0] / t - _lse_at(st["top"], st["tail_mean"], st["tail_count"], t)).exp()
        r = calibration_metrics(confidences=c, correct=st["correct"], n_bins=n_bins)
        pred_ece[_key(x)], pred_gap[_key(x)] = r.ece, r.signed_gap
    tokens["predicted_ece"], tokens["predicted_gap"] = pred_ece, pred_gap
    tokens["prediction"] = gap_verdict(res.signed_gap, pred_gap[_key(b)], margin)
    return tokens, temps, tau


def token_report(model, tokenizer, records: list, bs, *, predict: bool = False) -> dict:
    """A fine-tuned run's next-token calibration on held-out instruction records (the level the loss acts on):
    n, accuracy, mean confidence, signed gap, ECE. With ``predict`` (for the b = 0 run) also what smoothing at each
    b > 0 of ``bs`` would do to it: ``predicted_gap`` and ``prediction`` per b (:func:`token_level`). In Table 1's
    check the b = 0 model's prediction had the direction of the measured effect four times of four
    (docs/theory.md). Used by ``hf-lsce sweep`` and ``hf-lsce demo``."""
    from .calibration import calibration_metrics
    from .patching.models import text_config

    nonzero = [float(b) for b in bs if b]
    if not nonzero:
        raise ValueError(f"bs must hold a label smoothing b > 0; got {list(bs)!r}")
    st = token_statistics(model, tokenizer, records, progress=False)
    if not predict:  # the state only: no temperatures to fit
        r = calibration_metrics(confidences=st["confidence"], correct=st["correct"])
        return dict(n=r.n, accuracy=r.accuracy, mean_confidence=r.mean_confidence, signed_gap=r.signed_gap, ece=r.ece)
    t, _, _ = token_level(st, nonzero[0], nonzero, int(text_config(model).vocab_size))
    out = {k: t[k] for k in ("n", "accuracy", "mean_confidence", "signed_gap", "ece")}
    out["predicted_gap"] = {_key(b): t["predicted_gap"][_key(b)] for b in nonzero}
    out["prediction"] = {k: gap_verdict(t["signed_gap"], g) for k, g in out["predicted_gap"].items()}
    return out


# ------------------------------------------------------------------------------------------ the report
@dataclass
class TaskState:
    """One task's measured calibration, and the ECE it would have if softened by tau(b) for each b."""

    name: str
    n: int
    chance: float
    accuracy: float
    above_chance: bool
    ece: float
    rms: float
    mean_confidence: float
    signed_gap: float
    gap_low: float
    gap_high: float
    predicted_ece: dict = field(default_factory=dict)  # b -> ECE at tau(b)
    predicted_gap: dict = field(default_factory=dict)  # b -> signed gap at tau(b)
    # one answer set for every item (MMLU's letters, BoolQ's no/yes): the answer the model gives most, and how often
    fixed_answers: bool = False
    top_answer: str = ""
    top_answer_share: float = 0.0


@dataclass
class ModelDiagnosis:
    """What :func:`diagnose_model` measured and what it predicts; ``format()`` says it in words."""

    model: str
    label_smoothing: float
    hidden_size: int
    vocab_size: int
    state_prediction: str              # the counterfactual's "helps" | "little-effect" | "hurts" (not validated)
    state_suggested_b: float           # the counterfactual's b of lowest predicted value
    basis: str                         # "tasks above chance" or "tokens (no task above chance)"
    current_gap: float                 # pooled |signed gap| over the basis: what the prediction compares
    predicted_gap: dict                # b -> pooled |signed gap| at tau(b)
    current_ece: float                 # pooled ECE over the basis
    predicted_ece: dict                # b -> pooled ECE at tau(b)
    temperatures: dict                 # b -> T*(b) on the instruction tokens (b = 0 included)
    tokens: dict                       # token-level state
    tasks: list                        # TaskState dicts
    bound: dict                        # the spectral entropy bound (hf_lsce.theory.diagnose) and the observed one
    margin: float = 0.01
    # the counterfactual's rule on the next-token |signed gap| of the instruction records (not validated either)
    token_prediction: str = ""
    evidence: list = field(default_factory=list)
    caveats: list = field(default_factory=list)
    # the prediction: None (abstains, ``abstain_reason`` says why) until a probe is added (add_probe)
    prediction: str | None = None
    suggested_b: float | None = None
    abstain_reason: str = ABSTAIN_REASON
    probe: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def add_probe(self, sweep_report: dict) -> "ModelDiagnosis":
        """Make the measured probe (an :func:`hf_lsce.sweep.run_sweep` report holding b = 0 and this diagnosis' b,
        run from the same weights) the prediction; the state-based one is kept as ``state_prediction``. In place;
        returns self."""
        pr = probe_prediction(sweep_report, self.label_smoothing, self.margin)
        self.probe, self.prediction, self.abstain_reason = pr, pr["prediction"], ""
        # the probe tested one b: suggest it where it measurably helped at no accuracy cost, else 0
        self.suggested_b = self.label_smoothing if pr["prediction"] == "helps" and not pr["accuracy_cost"] else 0.0
        self.caveats = [c for c in self.caveats if c != _COUNTERFACTUAL_CAVEAT]
        self.caveats.append(f"the probe measures {pr['steps']} SFT steps of {pr['batch_size']} on "
                            f"{pr['dataset']} (seed {pr['seed']}); a longer run, other data or another seed can move "
                            "the single-token tasks differently (docs/theory.md)")
        return self

    def format(self) -> str:
        t = self.tokens
        lines = [f"hf-lsce diagnose {self.model}: D = {self.hidden_size}, V = {self.vocab_size:,}, b = {self.label_smoothing:g}",
                 f"tokens ({t['n']} completion tokens of held-out instructions): accuracy {t['accuracy']:.3f}, "
                 f"mean confidence {t['mean_confidence']:.3f}, signed gap {t['signed_gap']:+.3f}, ECE {t['ece']:.3f}; "
                 f"smoothing at b binds on {t['binding_share']:.0%} of them",
                 f"  fitted temperature: T*(0) = {self.temperatures['0']:.3f}, T*(b) = "
                 + ", ".join(f"{self.temperatures[k]:.3f} (b = {k})" for k in self.temperatures if k != "0"),
                 f"  entropy bound at the logit norms produced: {self.bound['entropy_bound_observed']:.3g} nats "
                 f"(spectral bound {self.bound['entropy_bound_spectral']:.3g}); smoothed target "
                 f"{self.bound['smoothed_target_entropy']:.3g} nats",
                 f"{'task':<14}{'n':>6}{'acc':>7}{'chance':>8}{'ECE':>7}{'gap':>8}   95% interval     "
                 + "".join(f"gap@b={b:<6}" for b in self.predicted_gap)]
        for s in self.tasks:
            mark = "" if s["above_chance"] else "  (at chance: not used)"
            lines.append(f"{s['name']:<14}{s['n']:>6}{s['accuracy']:>7.3f}{s['chance']:>8.3f}{s['ece']:>7.3f}"
                         f"{s['signed_gap']:>+8.3f}   [{s['gap_low']:+.3f}, {s['gap_high']:+.3f}]     "
                         + "".join(f"{s['predicted_gap'][b]:<+12.3f}" for b in self.predicted_gap) + mark)
        lines.append(f"pooled over {self.basis}: |signed gap| {self.current_gap:.3f} now, predicted "
                     + ", ".join(f"{v:.3f}" for v in self.predicted_gap.values()) + " at b = "
                     + ", ".join(self.predicted_gap) + f"; ECE {self.current_ece:.3f} now, predicted "
                     + ", ".join(f"{v:.3f}" for v in self.predicted_ece.values()))
        lines.append(f"state-based counterfactual at b = {self.label_smoothing:g} (not validated): "
                     f"{self.state_prediction}, its b of lowest predicted value {self.state_suggested_b:g}"
                     + (f"; at the next-token level {self.token_prediction} (|signed gap| {abs(t['signed_gap']):.3f} "
                        f"now, {abs(t['predicted_gap'][_key(self.label_smoothing)]):.3f} predicted)"
                        if self.token_prediction else ""))
        if self.probe is None:
            lines.append(f"prediction at b = {self.label_smoothing:g}: NONE (abstains): {self.abstain_reason}")
        if self.probe is not None:
            pr = self.probe
            lines.append(f"probe: {pr['steps']} SFT steps of {pr['batch_size']} at b = 0 and b = "
                         f"{self.label_smoothing:g} from these weights ({pr['dataset']}, {pr['seconds']:.0f} s); "
                         "ECE b = 0 -> b, paired change [95% interval], signed gap b = 0 -> b:")
            for name, t in pr["tasks"].items():
                lo, hi = t["ece_interval"]
                lines.append(f"  {name:<14}{t['ece'][0]:.3f} -> {t['ece'][1]:.3f}  {t['ece_change']:+.3f} "
                             f"[{lo:+.3f}, {hi:+.3f}]  gap {t['signed_gap'][0]:+.3f} -> {t['signed_gap'][1]:+.3f}"
                             + (f"  accuracy {t['accuracy_change']:+.3f} (lower)" if t["costs_accuracy"] else ""))
            cost = (f"; it cost accuracy on {', '.join(pr['accuracy_cost'])}" if pr["accuracy_cost"] else "")
            lines.append(f"measured prediction at b = {self.label_smoothing:g}: {self.prediction.upper()} "
                         f"(probe verdict: {pr['verdict']}{cost}; the state alone said {self.state_prediction}); "
                         f"suggested b = {self.suggested_b:g}")
        lines += [f"- {e}" for e in self.evidence]
        lines += [f"(caveat) {c}" for c in self.caveats]
        return "\n".join(lines)


def _chance(task) -> float:
    return sum(1.0 / len(it.choices) for it in task.items) / len(task.items)


def _key(b: float) -> str:
    return f"{b:g}"


def decide(current: float, predicted: dict, b: float, margin: float = 0.01) -> tuple[str, float]:
    """The prediction at ``b`` and the suggested b from the pooled miscalibration now (``current``) and predicted
    per b (``predicted``: b as text -> value; must hold ``b``)."""
    if not 0 < margin < 1:
        raise ValueError(f"margin must lie in (0, 1); got {margin!r}")
    delta = predicted[_key(b)] - current
    prediction = "helps" if delta < -margin else "hurts" if delta > margin else "little-effect"
    best_b, best = min(predicted.items(), key=lambda kv: kv[1])
    return prediction, (float(best_b) if best < current - margin else 0.0)


def gap_verdict(gap_before: float, gap_after: float, margin: float = 0.01) -> str:
    """The prediction's rule on one signed gap, before and after smoothing (measured, or predicted by the
    counterfactual): ``"helps"`` if its absolute value falls by more than ``margin``, ``"hurts"`` if it rises by more,
    else ``"little-effect"``."""
    return decide(abs(gap_before), {"1": abs(gap_after)}, 1.0, margin)[0]


def answer_lean(probs: torch.Tensor) -> tuple[int, float]:
    """(the option the model picks most, the share of items it picks it on) from per-item option probabilities
    (items x options): on a task answered from one answer set, the answer prior."""
    counts = torch.bincount(probs.argmax(-1), minlength=probs.shape[-1])
    top = int(counts.argmax())
    return top, float(counts[top]) / max(1, probs.shape[0])


# ------------------------------------------------------------------ measured: short paired fine-tunings (sweep, probe)
def verdicts(comparisons: dict) -> dict:
    """b (as text) -> verdict against b = 0 from ``comparisons[b][task]["ece"]`` (a paired difference with ``low`` /
    ``high``): better, worse, mixed, or no resolvable change."""
    out = {}
    for key, per_task in comparisons.items():
        down = [t for t, c in per_task.items() if c["ece"]["high"] < 0]
        up = [t for t, c in per_task.items() if c["ece"]["low"] > 0]
        out[key] = ("mixed" if down and up else "better" if down else "worse" if up else "no resolvable change")
    return out


def accuracy_costs(comparisons: dict) -> dict:
    """b (as text) -> the tasks whose accuracy is lower than at b = 0 with the interval below 0."""
    return {key: [t for t, c in per_task.items() if c["acc"]["high"] < 0] for key, per_task in comparisons.items()}


def suggest(pooled_ece: dict, verdict: dict, costs: dict | None = None) -> float:
    """The ``better`` b of lowest pooled ECE among those with no accuracy cost (``costs``: b -> tasks), else 0."""
    better = [k for k, v in verdict.items() if v == "better" and not (costs or {}).get(k)]
    return float(min(better, key=lambda k: pooled_ece[k])) if better else 0.0


def decide_sweep(report: dict) -> dict:
    """Fill ``verdict``, ``accuracy_cost``, ``suggested_b`` and ``lowest_ece_b`` of a report from its paired
    comparisons and pooled ECE (in place; also for a report saved by an earlier version)."""
    comparisons = report["versus_b0"]
    pooled_ece = {k: v["ece"] for k, v in report["pooled"].items()}
    report["verdict"], report["accuracy_cost"] = verdicts(comparisons), accuracy_costs(comparisons)
    report["suggested_b"] = suggest(pooled_ece, report["verdict"], report["accuracy_cost"])
    report["lowest_ece_b"] = suggest(pooled_ece, report["verdict"])  # the same, ignoring accuracy
    return report


def probe_rule(verdict: str, pooled_ece_b0: float, pooled_ece_b: float, b: float, margin: float = 0.01) -> str:
    """The probe's prediction from its verdict at b (:func:`verdicts`): ``better`` -> ``"helps"``,
    ``worse`` -> ``"hurts"``, ``no resolvable change`` -> ``"little-effect"``; ``mixed`` by the pooled ECE change
    (b minus 0) against ``margin``."""
    if verdict == "mixed":
        return decide(pooled_ece_b0, {_key(b): pooled_ece_b}, b, margin)[0]
    return PROBE_VERDICT[verdict]


def probe_prediction(report: dict, b: float, margin: float = 0.01) -> dict:
    """The prediction at ``b`` measured by short paired fine-tunings: an ``hf-lsce sweep`` report
    (:func:`hf_lsce.sweep.run_sweep`, or its ``sweep.json``) holding b = 0 and ``b``. The sweep's verdict at b
    (paired bootstraps of each task's ECE against b = 0) decides: ``better`` -> ``"helps"``, ``worse`` ->
    ``"hurts"``, ``no resolvable change`` -> ``"little-effect"``; ``mixed`` (some task resolved lower, another
    higher) by the pooled ECE change against ``margin``. Returns the prediction with its per-task evidence."""
    if not isinstance(report, dict) or not {"versus_b0", "results", "pooled"} <= set(report):
        raise TypeError("the probe must be an hf-lsce sweep report (hf_lsce.sweep.run_sweep's result or its "
                        "sweep.json)")
    key = _key(b)
    if key not in report["versus_b0"]:
        raise ValueError(f"the sweep report has no run at b = {b:g} (it has b = {', '.join(report['versus_b0'])}): "
                         f"probe at the b you diagnose (hf-lsce sweep --b 0,{b:g})")
    if "verdict" not in report or "accuracy_cost" not in report:
        decide_sweep(report)
    verdict = report["verdict"][key]
    p0, pb = report["pooled"]["0"]["ece"], report["pooled"][key]["ece"]
    prediction = probe_rule(verdict, p0, pb, b, margin)
    costs = set(report["accuracy_cost"][key])
    tasks = {}
    for name, c in report["versus_b0"][key].items():
        r0, rb = report["results"]["0"][name], report["results"][key][name]
        tasks[name] = {"n": r0["n"], "ece": [r0["ece"], rb["ece"]], "ece_change": c["ece"]["diff"],
                       "ece_interval": [c["ece"]["low"], c["ece"]["high"]],
                       "signed_gap": [r0["signed_gap"], rb["signed_gap"]], "accuracy": [r0["acc"], rb["acc"]],
                       "accuracy_change": c["acc"]["diff"], "costs_accuracy": name in costs}
    budget = report.get("budget", {})
    return {"prediction": prediction, "verdict": verdict, "b": float(b), "pooled_ece": [p0, pb],
            "tasks": tasks, "accuracy_cost": sorted(costs), "steps": budget.get("sft_steps"),
            "batch_size": budget.get("batch_size"), "lr": budget.get("lr"), "dataset": report.get("dataset"),
            "seed": report.get("seed"), "seconds": report.get("seconds", 0.0),
            "report": os.path.join(report["output_dir"], "sweep.json") if report.get("output_dir") else None}


def diagnose_model(model, tokenizer, *, label_smoothing: float = 0.1, tasks=DEFAULT_TASKS, records=DEFAULT_RECORDS,
                   n_records: int = 64, data_dir: str | None = None, limit=200, shots=None, b_grid=B_GRID,
                   margin: float = 0.01, batch_size: int = 16, max_length: int = 256, n_bins: int = 15,
                   name: str | None = None, progress: bool = True) -> ModelDiagnosis:
    """Measure ``model``'s calibration state and predict whether fine-tuning it with label smoothing ``b`` will
    lower its ECE (see the module docstring). ``records``: instruction data (names of installed QA sets, a file,
    or ``{prompt, completion}`` dicts); the last ``n_records`` are used. ``tasks``/``limit``/``shots``: as
    :func:`hf_lsce.calibration.tasks.resolve_tasks`."""
    from . import theory
    from .calibration import calibration_metrics, score_task
    from .calibration.metrics import signed_gap_interval
    from .calibration.tasks import LETTERS, resolve_tasks
    from .data import load_instruction_records
    from .patching.models import softcap_of, text_config

    b = label_smoothing
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < 1:
        raise ValueError(f"label_smoothing must lie in (0, 1); got {b!r}")
    grid = sorted({float(x) for x in b_grid} | {float(b)})
    if any(not 0 < x < 1 for x in grid):
        raise ValueError(f"b_grid values must lie in (0, 1); got {list(b_grid)!r}")
    if isinstance(n_records, bool) or not isinstance(n_records, int) or n_records < 1:
        raise ValueError(f"n_records must be a positive integer; got {n_records!r}")
    loaded = resolve_tasks(tasks, data_dir, shots=shots, limit=limit)  # before any model work: bad names fail now
    recs = load_instruction_records(records)[-n_records:]  # names: the installed QA sets; or a file, or dicts
    cfg = text_config(model)
    d, v = int(cfg.hidden_size), int(cfg.vocab_size)
    was_training = model.training
    model.eval()
    try:
        # ---------------------------------------------------------------- 1-2: the tokens and the temperatures
        st = token_statistics(model, tokenizer, recs, max_length=max_length, n_bins=n_bins, progress=progress)
        tokens, temps, tau = token_level(st, b, grid, v, margin=margin, n_bins=n_bins)
        tok_gap = tokens["predicted_gap"]

        # ---------------------------------------------------------------- 3: the tasks, softened by tau(b)
        states, scores = [], {}
        for task in loaded:
            s = score_task(model, tokenizer, task, batch_size=batch_size, n_bins=n_bins, progress=progress,
                           temperatures=sorted(set(tau.values())))
            scores[task.name] = s
            lo, hi = signed_gap_interval(s.probs.double(), s.labels)
            chance = _chance(task)
            se = math.sqrt(chance * (1 - chance) / len(task))
            soft = {k: calibration_metrics(s.probs_at(t), s.labels, n_bins=n_bins) for k, t in tau.items()}
            m = s.metrics
            fixed = task.kind == "letters" or all(it.choices == task.items[0].choices for it in task.items)
            top, share = answer_lean(s.probs)
            answer = LETTERS[top] if task.kind == "letters" else task.items[0].choices[top].strip() if fixed else ""
            states.append(TaskState(task.name, m.n, chance, m.accuracy, m.accuracy > chance + 1.96 * se, m.ece, m.rms,
                                    m.mean_confidence, m.signed_gap, lo, hi, {k: r.ece for k, r in soft.items()},
                                    {k: r.signed_gap for k, r in soft.items()}, fixed, answer, share))
    finally:
        model.train(was_training)

    # ---------------------------------------------------------------- pooling and the decision
    used = [s for s in states if s.above_chance]
    caveats = []
    if used:
        n = sum(s.n for s in used)
        current_ece = sum(s.ece * s.n for s in used) / n
        current = sum(abs(s.signed_gap) * s.n for s in used) / n
        predicted_ece = {k: sum(s.predicted_ece[k] * s.n for s in used) / n for k in tau}
        predicted = {k: sum(abs(s.predicted_gap[k]) * s.n for s in used) / n for k in tau}
        basis = "tasks above chance (" + ", ".join(s.name for s in used) + ")"
    else:
        current_ece, predicted_ece, basis = tokens["ece"], dict(tokens["predicted_ece"]), "tokens (no task above chance)"
        current, predicted = abs(tokens["signed_gap"]), {k: abs(v) for k, v in tok_gap.items()}
        caveats.append("no task is above chance for this model: the prediction rests on next-token calibration "
                       "of the instruction records alone")
    state_prediction, state_suggested = decide(current, predicted, b, margin)
    token_prediction = tokens["prediction"]
    spectral = theory.measure_rho(model, tokenizer) if hasattr(model, "get_output_embeddings") else {}
    spec_diag = theory.diagnose(d, v, spectral.get("rho", 0.0), b, softcap=softcap_of(model))
    observed_rho = tokens["max_logit_norm"] / math.sqrt(d)
    bound = dict(entropy_bound_spectral=spec_diag.entropy_bound, rho_spectral=spec_diag.rho,
                 entropy_bound_observed=theory.entropy_lower_bound(d, v, observed_rho), rho_observed=observed_rho,
                 smoothed_target_entropy=spec_diag.smoothed_target_entropy, softcap=spec_diag.softcap)

    evidence = []
    over = [s.name for s in used if s.gap_low > 0]
    under = [s.name for s in used if s.gap_high < 0]
    if over:
        evidence.append(f"over-confident (signed gap's 95% interval above 0) on: {', '.join(over)}")
    if under:
        evidence.append(f"under-confident (interval below 0) on: {', '.join(under)}: smoothing pushes these further "
                        "under")
    evidence.append(f"at the token level the model is {'over' if tokens['signed_gap'] > 0 else 'under'}-confident by "
                    f"{abs(tokens['signed_gap']):.3f}; smoothing at b = {b:g} binds on {tokens['binding_share']:.0%} of "
                    f"the tokens and fits a temperature {tau[_key(b)]:.2f}x that of plain SFT")
    evidence.append(f"pooled |signed gap| {current:.3f} now, {predicted[_key(b)]:.3f} predicted at b = {b:g} "
                    f"(margin {margin:g}); pooled ECE {current_ece:.3f} now, {predicted_ece[_key(b)]:.3f} predicted")
    if bound["entropy_bound_observed"] >= bound["smoothed_target_entropy"]:
        caveats.append("at the logit norms it produces the head cannot be more confident than the smoothed target: "
                       "smoothing would hardly bind unless training grows the logits")
    lean = [f"{s.name} ({s.top_answer_share:.0%} '{s.top_answer}')" for s in states
            if s.fixed_answers and s.top_answer_share >= PRIOR_LEAN]
    if lean:
        caveats.append(f"its answers lean to one choice on {', '.join(lean)}: on tasks answered from one answer set, "
                       "fine-tuning with smoothing moved that prior, in either direction (Table 1: Gemma-3-270m's BoolQ "
                       "answers from mostly 'yes' to mostly 'no', SmolLM2's towards balance), which the state-based "
                       "counterfactual cannot see: measure it with --probe (docs/theory.md)")
    caveats.append(_COUNTERFACTUAL_CAVEAT)
    out = ModelDiagnosis(name or getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
                         float(b), d, v, state_prediction, state_suggested, basis, current, predicted, current_ece,
                         predicted_ece,
                         temps, tokens, [asdict(s) for s in states], bound, margin, token_prediction, evidence,
                         caveats)
    out.scores = scores  # {task: TaskScores} of the model as it is (not serialised): callers reuse them
    return out


def plot_diagnosis(diag: ModelDiagnosis, path: str | None = None):
    """Two panels: each task's signed gap with its interval (over- vs under-confidence), and the pooled ECE
    and ECE predicted against b (the model's own at b = 0)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.6, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    names = [s["name"] for s in diag.tasks] + ["tokens"]
    gaps = [s["signed_gap"] for s in diag.tasks] + [diag.tokens["signed_gap"]]
    lows = [s["signed_gap"] - s["gap_low"] for s in diag.tasks] + [0.0]
    colours = [("C3" if g > 0 else "C0") if (s.get("above_chance", True)) else "0.7"
               for g, s in zip(gaps, diag.tasks + [{}])]
    ax1.bar(range(len(names)), gaps, yerr=lows, color=colours, capsize=3)
    ax1.axhline(0, color="k", lw=0.8)
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("mean confidence - accuracy")
    ax1.set_title("over- (red) / under-confident (blue); grey: at chance", fontsize=9)
    bs = [0.0] + [float(k) for k in diag.predicted_ece]
    ax2.plot(bs, [diag.current_gap] + list(diag.predicted_gap.values()), marker="o", label="|signed gap|")
    ax2.plot(bs, [diag.current_ece] + list(diag.predicted_ece.values()), marker="s", label="ECE")
    title = (f"no prediction without a probe (the state-based counterfactual, not validated: "
             f"{diag.state_prediction})")
    if diag.probe is not None:  # the probe's measured pooled ECE at 0 and b
        ax2.plot([0.0, diag.label_smoothing], diag.probe["pooled_ece"], marker="*", ms=11, ls=":", color="k",
                 label=f"ECE after {diag.probe['steps']} SFT steps at 0 and b\n(probe, measured, all its tasks)")
        title = (f"measured by the probe at b = {diag.label_smoothing:g}: {diag.prediction} "
                 f"(the state alone: {diag.state_prediction})")
    ax2.axvline(diag.label_smoothing, color="0.6", ls="--", lw=0.8)
    ax2.set_xlabel("label smoothing b")
    ax2.set_ylabel("pooled, predicted")
    ax2.legend(fontsize=8)
    ax2.set_title(title, fontsize=9)
    ax2.grid(alpha=0.3)
    fig.suptitle(diag.model, fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
