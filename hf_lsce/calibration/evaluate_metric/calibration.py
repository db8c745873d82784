"""An `evaluate` metric for calibration: ``evaluate.load(hf_lsce.calibration.evaluate_metric_path())``.

predictions: per-example probability vectors over the classes; references: the class indices.
Returns accuracy, ECE, MCE, RMS, SCE, ACE, Brier (multiclass and top-label), NLL and mean confidence,
computed by ``hf_lsce.calibration.calibration_metrics`` (conventions documented there).
"""
import datasets
import evaluate

from hf_lsce.calibration.metrics import calibration_metrics

_DESCRIPTION = __doc__
_KWARGS_DESCRIPTION = """
Args:
    predictions (list of list of float): probabilities over the classes; each row sums to 1.
    references (list of int): the true class of each example.
    n_bins (int, default 15): equal-width bins for ECE, MCE, RMS and SCE; equal-count ranges for ACE.
Returns:
    dict of floats: n, accuracy, ece, mce, rms, brier_top, mean_confidence, signed_gap, sce, ace, brier, nll, n_bins.
Example:
    >>> metric = evaluate.load(hf_lsce.calibration.evaluate_metric_path())
    >>> metric.compute(predictions=[[0.9, 0.1], [0.2, 0.8]], references=[0, 0])["ece"]
"""
_CITATION = """\
@inproceedings{guo2017calibration, title={On Calibration of Modern Neural Networks}, author={Guo, Chuan and Pleiss, Geoff and Sun, Yu and Weinberger, Kilian Q.}, booktitle={ICML}, year={2017}}
@inproceedings{nixon2019measuring, title={Measuring Calibration in Deep Learning}, author={Nixon, Jeremy and Dusenberry, Michael W. and Zhang, Linchuan and Jerfel, Ghassen and Tran, Dustin}, booktitle={CVPR Workshops}, year={2019}}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Calibration(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64")),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, n_bins: int = 15):
        return calibration_metrics(predictions, references, n_bins=n_bins).scalars()
