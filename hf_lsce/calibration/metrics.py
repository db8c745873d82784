"""Calibration metrics: ECE, MCE, RMS, SCE, ACE, Brier, NLL and reliability-diagram data.

Conventions (all metrics compute in float64 on CPU; inputs may be tensors, arrays or lists):

* Top-label metrics (ECE, MCE, RMS, top-label Brier, the reliability diagram) need only each
  prediction's confidence (the probability of the predicted class) and whether it was correct.
  Multiclass metrics (SCE, ACE, multiclass Brier, NLL) need the full probability vectors.
* Equal-width bins: ``n_bins`` bins with edges ``torch.linspace(0, 1, n_bins + 1)``; a confidence c
  falls in bin m when ``edge[m] <= c < edge[m+1]`` (left-closed), the same search torchmetrics uses.
  A confidence of exactly 1.0 goes into the last bin (``ones_in_last_bin=True``, our default, and
  Guo et al.'s ``((M-1)/M, 1]``). torchmetrics instead gives exactly-1.0 confidences a bin of their
  own, which matters for bf16 language models whose softmax often rounds to 1.0; pass
  ``ones_in_last_bin=False`` to reproduce torchmetrics exactly. Without exact 1.0s both agree.
* Empty bins take no part: ECE and RMS weight each bin by its share of samples; MCE is the largest
  gap over non-empty bins (torchmetrics' max over all bins is the same, since an empty bin's gap is 0).
* ECE = sum_m (n_m / N) |acc_m - conf_m|; RMS = sqrt(sum_m (n_m / N) (acc_m - conf_m)^2), which is
  torchmetrics' ``norm="l2"`` (not debiased); MCE = max_m |acc_m - conf_m|, torchmetrics' ``"max"``.
* The signed gap is mean confidence minus accuracy (top label): > 0 over-confident, < 0 under-confident. ECE
  and RMS cannot tell the two apart; label smoothing only corrects the first (it lowers confidence).
* SCE and ACE follow Nixon et al. 2019, "Measuring Calibration in Deep Learning": both are classwise.
  SCE bins each class's probability with equal-width bins and averages the classes' weighted gaps.
  ACE sorts each class's probabilities into ``n_bins`` ranges holding equal numbers of predictions
  (``numpy.array_split`` sizes) and averages |acc - conf| over all ranges and classes, unweighted;
  with ``threshold > 0`` only probabilities above it count (Nixon's TACE). netcal's ``ACE`` is a
  different quantity (the unweighted mean over equal-width non-empty bins of the top label), so
  numbers labelled ACE in netcal-based papers are not comparable with these.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

__all__ = [
    "ReliabilityData", "CalibrationResult", "reliability_data", "expected_calibration_error",
    "maximum_calibration_error", "rms_calibration_error", "static_calibration_error",
    "adaptive_calibration_error", "brier_score", "top_label_brier_score", "negative_log_likelihood",
    "calibration_metrics", "top_label", "paired_bootstrap", "signed_gap_interval",
]

_SUM_TOL = 1e-3  # rows of a probability matrix must sum to 1 within this (bf16 softmax sums ~1e-3 off)


# ------------------------------------------------------------------------------------ validation
def _as_float64(x, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu", torch.float64)
    else:
        try:
            t = torch.as_tensor(x, dtype=torch.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"`{name}` must be a tensor, array or list of numbers; got {type(x).__name__}") from e
    return t


def _check_confidences(confidences, correct) -> tuple[torch.Tensor, torch.Tensor]:
    conf = _as_float64(confidences, "confidences").reshape(-1)
    corr = _as_float64(correct, "correct").reshape(-1)
    if conf.numel() != corr.numel():
        raise ValueError(f"`confidences` and `correct` must have the same length; got {conf.numel()} and "
                         f"{corr.numel()}")
    if conf.numel() == 0:
        raise ValueError("no predictions to measure: `confidences` is empty (a task with no items?)")
    if not torch.isfinite(conf).all():
        raise ValueError("`confidences` contains NaN or inf; check the model's probabilities")
    if (conf < 0).any() or (conf > 1).any():
        raise ValueError(f"`confidences` must lie in [0, 1]; got values in [{conf.min():.4g}, {conf.max():.4g}]. "
                         "Pass probabilities (softmax), not logits")
    if not ((corr == 0) | (corr == 1)).all():
        raise ValueError("`correct` must hold 0/1 (or booleans): whether each prediction was right")
    return conf, corr


def _check_probs(probs, labels) -> tuple[torch.Tensor, torch.Tensor]:
    p = _as_float64(probs, "probs")
    if p.dim() != 2:
        raise ValueError(f"`probs` must be 2-D (samples, classes); got shape {tuple(p.shape)}")
    try:
        y = torch.as_tensor(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"`labels` must be integer class indices (a list, array or tensor of ints), got "
                        f"{type(labels).__name__} {labels!r:.60}: {e}. Map answer strings to their index first") from e
    if y.dtype == torch.bool or y.is_complex():
        raise TypeError(f"`labels` must be integer class indices, got dtype {y.dtype}")
    if y.is_floating_point():
        if not torch.equal(y, y.round()):
            raise TypeError("`labels` must be integer class indices")
    y = y.long()
    if p.shape[0] != y.numel():
        raise ValueError(f"`probs` has {p.shape[0]} rows but `labels` has {y.numel()} entries")
    if p.shape[0] == 0:
        raise ValueError("no predictions to measure: `probs` is empty (a task with no items?)")
    if p.shape[1] < 2:
        raise ValueError(f"`probs` needs at least 2 classes; got {p.shape[1]}")
    if not torch.isfinite(p).all():
        raise ValueError("`probs` contains NaN or inf")
    if (p < 0).any() or (p > 1).any():
        raise ValueError(f"`probs` must lie in [0, 1]; got values in [{p.min():.4g}, {p.max():.4g}]. "
                         "Pass probabilities (softmax over the classes), not logits")
    worst = (p.sum(1) - 1).abs().max()
    if worst > _SUM_TOL:
        raise ValueError(f"each row of `probs` must sum to 1 (within {_SUM_TOL}); the worst row is off by "
                         f"{worst:.3g}. Apply a softmax over the classes first")
    if (y < 0).any() or (y >= p.shape[1]).any():
        raise ValueError(f"`labels` must be class indices in [0, {p.shape[1] - 1}]; got values in "
                         f"[{int(y.min())}, {int(y.max())}]")
    return p, y


def _check_bins(n_bins: int) -> None:
    if not isinstance(n_bins, int) or isinstance(n_bins, bool) or n_bins < 1:
        raise ValueError(f"`n_bins` must be a positive integer; got {n_bins!r}")


def top_label(probs, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence, correct) of the top label of each row of ``probs``; ties go to the lowest index."""
    return _top_label(*_check_probs(probs, labels))


def _top_label(p: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    conf, pred = p.max(1)
    return conf, (pred == y).double()


# ----------------------------------------------------------------------------------- equal width
@dataclass
class ReliabilityData:
    """Per-bin statistics of equal-width binning: what a reliability diagram draws."""

    edges: list[float]
    count: list[int]
    accuracy: list[float]     # NaN for an empty bin
    confidence: list[float]   # NaN for an empty bin

    @property
    def n_bins(self) -> int:
        return len(self.count)


def _bin_stats(conf: torch.Tensor, corr: torch.Tensor, n_bins: int, ones_in_last_bin: bool):
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    idx = torch.bucketize(conf.contiguous(), edges, right=True) - 1          # left-closed bins, as torchmetrics
    slots = n_bins if ones_in_last_bin else n_bins + 1          # torchmetrics: 1.0 has its own slot
    idx = idx.clamp(0, slots - 1)
    count = torch.zeros(slots, dtype=torch.float64).scatter_add_(0, idx, torch.ones_like(conf))
    s_conf = torch.zeros(slots, dtype=torch.float64).scatter_add_(0, idx, conf)
    s_acc = torch.zeros(slots, dtype=torch.float64).scatter_add_(0, idx, corr)
    nz = count > 0
    return edges, count, s_acc / count.clamp_min(1), s_conf / count.clamp_min(1), nz


def _reliability(edges, count, acc, cf, nz, ones_in_last_bin: bool) -> ReliabilityData:
    if not ones_in_last_bin:  # fold torchmetrics' separate 1.0 slot back for drawing
        count, acc, cf, nz = _merge_ones_slot(count, acc, cf)
    nan = float("nan")
    return ReliabilityData(edges=edges.tolist(), count=[int(c) for c in count.tolist()],
                           accuracy=[a if m else nan for a, m in zip(acc.tolist(), nz.tolist())],
                           confidence=[c if m else nan for c, m in zip(cf.tolist(), nz.tolist())])


def reliability_data(confidences, correct, n_bins: int = 15, *, ones_in_last_bin: bool = True) -> ReliabilityData:
    """Per-bin count, accuracy and mean confidence (equal-width bins, conventions in the module doc)."""
    _check_bins(n_bins)
    conf, corr = _check_confidences(confidences, correct)
    return _reliability(*_bin_stats(conf, corr, n_bins, ones_in_last_bin), ones_in_last_bin)


def _merge_ones_slot(count, acc, cf):
    c = count[:-1].clone()
    a, f = acc[:-1] * count[:-1], cf[:-1] * count[:-1]
    c[-1] += count[-1]
    a[-1] += acc[-1] * count[-1]
    f[-1] += cf[-1] * count[-1]
    return c, a / c.clamp_min(1), f / c.clamp_min(1), c > 0


def _gaps_of(count, acc, cf, nz, n):
    """|acc - conf| and sample share of every non-empty bin."""
    return (acc - cf)[nz].abs(), count[nz] / n


def _ece(gap, w) -> float:
    return float((gap * w).sum())


def _mce(gap, w) -> float:
    return float(gap.max())


def _rms(gap, w) -> float:
    return float((gap.square() * w).sum().sqrt())


def _gaps(confidences, correct, n_bins, ones_in_last_bin):
    _check_bins(n_bins)
    conf, corr = _check_confidences(confidences, correct)
    _, count, acc, cf, nz = _bin_stats(conf, corr, n_bins, ones_in_last_bin)
    return _gaps_of(count, acc, cf, nz, conf.numel())


def expected_calibration_error(confidences, correct, n_bins: int = 15, *, ones_in_last_bin: bool = True) -> float:
    """ECE: the sample-weighted mean over equal-width bins of |accuracy - confidence|."""
    return _ece(*_gaps(confidences, correct, n_bins, ones_in_last_bin))


def maximum_calibration_error(confidences, correct, n_bins: int = 15, *, ones_in_last_bin: bool = True) -> float:
    """MCE: the largest |accuracy - confidence| over non-empty equal-width bins."""
    return _mce(*_gaps(confidences, correct, n_bins, ones_in_last_bin))


def rms_calibration_error(confidences, correct, n_bins: int = 15, *, ones_in_last_bin: bool = True) -> float:
    """RMS calibration error: sqrt of the sample-weighted mean of squared bin gaps (torchmetrics' l2)."""
    return _rms(*_gaps(confidences, correct, n_bins, ones_in_last_bin))


def top_label_brier_score(confidences, correct) -> float:
    """Mean of (confidence - correct)^2 over predictions: the Brier score of the top label only."""
    return _brier_top(*_check_confidences(confidences, correct))


def _brier_top(conf, corr) -> float:
    return float((conf - corr).square().mean())


# ------------------------------------------------------------------------------------- classwise
def static_calibration_error(probs, labels, n_bins: int = 15) -> float:
    """SCE (Nixon et al. 2019): classwise ECE with equal-width bins, averaged over the classes."""
    _check_bins(n_bins)
    return _sce(*_check_probs(probs, labels), n_bins)


def _sce(p, y, n_bins) -> float:
    n, k = p.shape
    onehot = torch.nn.functional.one_hot(y, k).double()
    total = 0.0
    for c in range(k):
        _, count, acc, cf, nz = _bin_stats(p[:, c], onehot[:, c], n_bins, True)
        total += float(((acc - cf)[nz].abs() * count[nz]).sum() / n)
    return total / k


def adaptive_calibration_error(probs, labels, n_bins: int = 15, *, threshold: float = 0.0) -> float:
    """ACE (Nixon et al. 2019): classwise, ``n_bins`` equal-count ranges per class, unweighted mean.

    Each class's predictions (those above ``threshold``; all of them by default) are sorted by the
    class's probability and split into ``min(n_bins, count)`` ranges whose sizes differ by at most
    one (``numpy.array_split``); ACE is the mean of |acc - conf| over every range of every class.
    ``threshold > 0`` gives Nixon's thresholded variant (TACE).
    """
    _check_bins(n_bins)
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"`threshold` must lie in [0, 1); got {threshold}")
    return _ace(*_check_probs(probs, labels), n_bins, threshold)


def _ace(p, y, n_bins, threshold=0.0) -> float:
    k = p.shape[1]
    gaps = []
    for c in range(k):
        keep = p[:, c] > threshold if threshold > 0 else torch.ones_like(y, dtype=torch.bool)
        pc, hit = p[keep, c], (y[keep] == c).double()
        if pc.numel() == 0:
            continue
        order = torch.argsort(pc, stable=True)
        for chunk in torch.tensor_split(order, min(n_bins, pc.numel())):
            gaps.append(float((hit[chunk].mean() - pc[chunk].mean()).abs()))
    if not gaps:
        raise ValueError(f"no probability lies above `threshold`={threshold}; lower it")
    return sum(gaps) / len(gaps)


def brier_score(probs, labels) -> float:
    """Multiclass Brier score: mean over samples of sum_k (p_k - 1[y = k])^2 (range [0, 2])."""
    return _brier(*_check_probs(probs, labels))


def _brier(p, y) -> float:
    onehot = torch.nn.functional.one_hot(y, p.shape[1]).double()
    return float((p - onehot).square().sum(1).mean())


def negative_log_likelihood(probs, labels, eps: float = 1e-12) -> float:
    """Mean of -log p_y (a probability of 0 is clamped to ``eps`` so the result stays finite)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
        raise ValueError(f"`eps` must be a number in (0, 1) (the smallest probability counted, which keeps the "
                         f"result finite); got {eps!r}")
    return _nll(*_check_probs(probs, labels), eps)


def _nll(p, y, eps=1e-12) -> float:
    return float(-p.gather(1, y[:, None]).clamp_min(eps).log().mean())


# ---------------------------------------------------------------------------------------- bundle
@dataclass
class CalibrationResult:
    """Every metric for one set of predictions; ``reliability`` holds the diagram's bins."""

    n: int
    accuracy: float
    ece: float
    mce: float
    rms: float
    brier_top: float
    mean_confidence: float
    signed_gap: float = 0.0  # mean confidence - accuracy: > 0 over-confident, < 0 under-confident
    sce: float | None = None
    ace: float | None = None
    brier: float | None = None
    nll: float | None = None
    n_bins: int = 15
    reliability: ReliabilityData | None = field(default=None, repr=False)

    def scalars(self) -> dict[str, float]:
        """The metrics as a flat dict of floats (None entries dropped): what loggers want."""
        d = asdict(self)
        d.pop("reliability")
        return {k: float(v) for k, v in d.items() if v is not None}

    def to_dict(self) -> dict:
        return asdict(self)


def calibration_metrics(probs=None, labels=None, *, confidences=None, correct=None, n_bins: int = 15,
                        ones_in_last_bin: bool = True) -> CalibrationResult:
    """All metrics at once, from ``probs`` + ``labels`` (everything) or ``confidences`` + ``correct``
    (top-label metrics only, e.g. next-token calibration over a 256K vocabulary)."""
    if (probs is None) == (confidences is None):
        raise ValueError("pass either `probs` and `labels`, or `confidences` and `correct`")
    _check_bins(n_bins)
    extra = {}
    if probs is not None:  # validated once; every metric below reads the checked tensors
        if labels is None:
            raise ValueError("`labels` is required with `probs`")
        p, y = _check_probs(probs, labels)
        conf, corr = _top_label(p, y)
        extra = dict(sce=_sce(p, y, n_bins), ace=_ace(p, y, n_bins), brier=_brier(p, y), nll=_nll(p, y))
    elif correct is None:
        raise ValueError("`correct` is required with `confidences`")
    else:
        conf, corr = _check_confidences(confidences, correct)
    bins = _bin_stats(conf, corr, n_bins, ones_in_last_bin)  # binned once for ECE, MCE, RMS and the diagram
    gap, w = _gaps_of(*bins[1:], conf.numel())
    return CalibrationResult(
        n=conf.numel(), accuracy=float(corr.mean()), ece=_ece(gap, w), mce=_mce(gap, w), rms=_rms(gap, w),
        brier_top=_brier_top(conf, corr), mean_confidence=float(conf.mean()),
        signed_gap=float(conf.mean() - corr.mean()), n_bins=n_bins,
        reliability=_reliability(*bins, ones_in_last_bin), **extra)


@dataclass
class PairedDifference:
    """``metric(b) - metric(a)`` on the same items, with a percentile bootstrap interval."""

    metric: str
    a: float
    b: float
    diff: float
    low: float
    high: float
    level: float

    @property
    def significant(self) -> bool:
        """The interval excludes 0."""
        return self.low > 0 or self.high < 0

    def describe(self, name_a: str = "a", name_b: str = "b") -> str:
        if not self.significant:
            return (f"{self.metric} {name_b} vs {name_a}: {self.b:.3f} vs {self.a:.3f}, no clear change "
                    f"({self.diff:+.3f}, {self.level:.0%} interval [{self.low:+.3f}, {self.high:+.3f}] contains 0)")
        way = "lower" if self.diff < 0 else "higher"
        return (f"{self.metric} {name_b} vs {name_a}: {self.b:.3f} vs {self.a:.3f}, {way} ({self.diff:+.3f}, "
                f"{self.level:.0%} interval [{self.low:+.3f}, {self.high:+.3f}])")


_PAIRED = {"ece": lambda c, k, n: _ece(*_gaps_of(*_bin_stats(c, k, n, True)[1:], c.numel())),
           "rms": lambda c, k, n: _rms(*_gaps_of(*_bin_stats(c, k, n, True)[1:], c.numel())),
           "acc": lambda c, k, n: float(k.mean()),
           "signed_gap": lambda c, k, n: float(c.mean() - k.mean())}


def signed_gap_interval(probs, labels, level: float = 0.95) -> tuple[float, float]:
    """Normal-approximation interval of the top-label signed gap (mean confidence minus accuracy) over the items:
    above 0 over-confident, below 0 under-confident, at that level."""
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    p, y = _check_probs(probs, labels)
    conf, corr = _top_label(p, y)
    d = (conf - corr).double()
    z = float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(0.5 + level / 2, dtype=torch.float64)))
    half = z * float(d.std(unbiased=True)) / math.sqrt(d.numel()) if d.numel() > 1 else float("inf")
    return float(d.mean()) - half, float(d.mean()) + half


def paired_bootstrap(probs_a, probs_b, labels, *, metric: str = "ece", n_bins: int = 15, n_boot: int = 1000,
                     level: float = 0.95, seed: int = 0) -> PairedDifference:
    """How much ``metric`` changes from predictions ``a`` to ``b`` on the same items, with a paired
    percentile bootstrap interval (items resampled jointly), so a small evaluation set does not read
    noise as an effect. ``metric``: "ece", "rms", "acc", "signed_gap" (top-label), or "nll"."""
    if metric not in (*_PAIRED, "nll"):
        raise ValueError(f"metric must be one of {sorted((*_PAIRED, 'nll'))}, got {metric!r}")
    _check_bins(n_bins)
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 10:
        raise ValueError(f"n_boot must be an integer >= 10, got {n_boot!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    pa, y = _check_probs(probs_a, labels)
    pb, _ = _check_probs(probs_b, labels)
    if pa.shape != pb.shape:
        raise ValueError(f"probs_a {tuple(pa.shape)} and probs_b {tuple(pb.shape)} must describe the same items")

    def value(p, idx):
        if metric == "nll":
            return _nll(p[idx], y[idx])
        c, k = _top_label(p[idx], y[idx])
        return _PAIRED[metric](c, k, n_bins)

    everything = torch.arange(y.numel())
    va, vb = value(pa, everything), value(pb, everything)
    g = torch.Generator().manual_seed(seed)
    diffs = []
    for _ in range(n_boot):
        idx = torch.randint(0, y.numel(), (y.numel(),), generator=g)
        diffs.append(value(pb, idx) - value(pa, idx))
    d = torch.tensor(diffs, dtype=torch.float64)
    lo, hi = torch.quantile(d, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return PairedDifference(metric, va, vb, vb - va, lo, hi, level)
