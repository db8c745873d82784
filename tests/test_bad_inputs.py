"""Bad input gets a clear, early error; nothing the user owns is lost.

A sweep over the public API (the op, the patch, calibration, ATS, the data loaders and the command line)
with the mistakes users make: each must raise the exact exception type named here with a message naming the
argument, before any work, and never leave a user's file changed. Valid neighbours of the bad values are
checked to give the right number (against fp64 torch), so the checks do not refuse good input.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_lsce import apply_lsce_patch, linear_cross_entropy, revert_lsce_patch

N, D, V = 7, 5, 11


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g, dtype=dtype)
    w = torch.randn(V, D, generator=g, dtype=dtype)
    y = torch.randint(0, V, (N,), generator=g)
    return h, w, y


def _reference(h, w, y, b=0.0, reduction="mean"):
    return F.cross_entropy(h.double() @ w.double().T, y, label_smoothing=b, reduction=reduction)


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    revert_lsce_patch()


# ------------------------------------------------------------------------------------------------ the op
BAD_OP = [
    (dict(hidden="x"), TypeError, "hidden must be a torch.Tensor"),
    (dict(hidden=torch.ones(N, D, dtype=torch.int64)), TypeError, "hidden must be float16"),
    (dict(weight=torch.ones(V, D, dtype=torch.float64)), TypeError, "weight dtype"),
    (dict(weight=torch.ones(V * D)), ValueError, r"weight must have shape \(V, D\)"),
    (dict(hidden=torch.ones(N, 0), weight=torch.ones(V, 0)), ValueError, "hidden size D must be at least 1"),
    (dict(weight=torch.ones(V, D + 1)), ValueError, "must equal weight.shape"),
    (dict(weight=torch.ones(0, D)), ValueError, "vocabulary size V must be at least 1"),
    (dict(targets=torch.zeros(N)), TypeError, "targets must hold integer token ids"),
    (dict(targets=torch.zeros(N + 1, dtype=torch.long)), ValueError, "targets shape"),
    (dict(targets=torch.full((N,), V)), ValueError, r"targets must be in \[0, 11\)"),
    (dict(targets=torch.full((N,), -5)), ValueError, "or equal ignore_index"),
    (dict(bias=torch.ones(V + 1)), ValueError, r"bias must have shape \(V,\)"),
    (dict(bias=torch.ones(V, dtype=torch.float64)), TypeError, "bias dtype"),
    (dict(bias=[1.0] * V), TypeError, "bias must be a torch.Tensor"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(reduction=None), ValueError, "reduction must be one of"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (dict(ignore_index=True), TypeError, "ignore_index must be an int"),
    (dict(ignore_index=2 ** 70), ValueError, "ignore_index must fit in int64"),
    (dict(shift=2), TypeError, "shift must be True or False"),
    (dict(shift=-1), TypeError, "shift must be True or False"),
    (dict(shift="yes"), TypeError, "shift must be True or False"),
    (dict(return_stats=1), TypeError, "return_stats must be True or False"),
    (dict(softcap=0.0), ValueError, "softcap must be None or a finite positive number"),
    (dict(softcap=-3.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=True), ValueError, "softcap"),
    (dict(num_items_in_batch=0), ValueError, "num_items_in_batch is 0 but"),
    (dict(num_items_in_batch=torch.tensor(0)), ValueError, "num_items_in_batch is 0 but"),
    (dict(num_items_in_batch=0.5), ValueError, "whole number"),
    (dict(num_items_in_batch=torch.tensor(2.5)), ValueError, "whole number"),
    (dict(num_items_in_batch=-1), ValueError, "whole number"),
    (dict(num_items_in_batch=float("nan")), ValueError, "finite"),
    (dict(num_items_in_batch=float("inf")), ValueError, "finite"),
    (dict(num_items_in_batch=torch.tensor(float("inf"))), ValueError, "finite"),
    (dict(num_items_in_batch=torch.tensor([5, 6])), ValueError, "one-element tensor"),
    (dict(num_items_in_batch="5"), TypeError, "num_items_in_batch must be a number"),
    (dict(num_items_in_batch=True), TypeError, "num_items_in_batch must be a number"),
    (dict(num_items_in_batch=5, reduction="none"), ValueError, "cannot be used with reduction='none'"),
    (dict(label_smoothing=1.5), ValueError, r"label_smoothing must lie in \[0, 1\]"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
    (dict(label_smoothing="high"), TypeError, "label_smoothing must be a float"),
    (dict(label_smoothing=torch.zeros(N + 1)), ValueError, "per-token label_smoothing"),
    (dict(label_smoothing=torch.zeros(N, dtype=torch.long)), TypeError, "floating point"),
    (dict(label_smoothing=torch.full((N,), 2.0)), ValueError, r"lie in \[0, 1\]"),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad,exc,match", BAD_OP, ids=[f"{list(b)[0]}={str(list(b.values())[0])[:20]}" for b, _, _ in BAD_OP])
def test_op_rejects_bad_arguments_with_the_exact_type(bad, exc, match, backend):
    h, w, y = _inputs()
    kw = dict(hidden=h, weight=w, targets=y, backend=backend)
    if bad.get("backend") is not None:
        kw.pop("backend")
    kw.update(bad)
    with pytest.raises(exc, match=match):
        linear_cross_entropy(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), **kw)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(b=st.floats(allow_nan=True, allow_infinity=True, width=32))
def test_label_smoothing_values_property(b):
    """Any float: in [0, 1] gives torch's smoothed loss; anything else a ValueError, never a NaN."""
    h, w, y = _inputs()
    if 0 <= b <= 1:
        got = linear_cross_entropy(h, w, y, label_smoothing=b, backend="torch")
        assert math.isclose(float(got), float(_reference(h, w, y, b)), rel_tol=1e-5, abs_tol=1e-6)
    else:
        with pytest.raises(ValueError):
            linear_cross_entropy(h, w, y, label_smoothing=b, backend="torch")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.one_of(st.floats(-1e7, 1e7), st.sampled_from([float("nan"), float("inf"), -float("inf")]),
                   st.integers(-5, 10 ** 6)),
       as_tensor=st.booleans())
def test_num_items_in_batch_property(n, as_tensor):
    """A count (finite, whole, > 0 here since every token counts): sum / n. Anything else: ValueError.
    (Counts are bounded by realistic token numbers: the divisor is computed in float32.)"""
    h, w, y = _inputs()
    arg = torch.tensor(n, dtype=torch.float64) if as_tensor else n
    ok = math.isfinite(n) and n == math.floor(n) and n >= 1
    if ok:
        got = linear_cross_entropy(h, w, y, num_items_in_batch=arg, backend="torch")
        assert got.dim() == 0
        assert math.isclose(float(got), float(_reference(h, w, y, reduction="sum")) / n, rel_tol=1e-5)
    else:
        with pytest.raises(ValueError):
            linear_cross_entropy(h, w, y, num_items_in_batch=arg, backend="torch")


def test_num_items_shapes_and_an_all_ignored_batch():
    h, w, y = _inputs()
    a = linear_cross_entropy(h, w, y, num_items_in_batch=9)
    b = linear_cross_entropy(h, w, y, num_items_in_batch=torch.tensor([9]))  # shape (1,): still a scalar loss
    assert b.shape == () and torch.equal(a, b)
    ignored = torch.full((N,), -100)
    assert float(linear_cross_entropy(h, w, ignored, num_items_in_batch=0)) == 0.0  # nothing to divide: 0, no NaN


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_double_backward_is_a_clear_error(backend):
    h, w, y = _inputs()
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, y, backend=backend)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_second_backward_with_retain_graph_equals_the_first():
    """A training call hands the gradients its forward computed to the first backward; a second backward through the
    same graph computes them the same way: identical, not merely close."""
    h, w, y = _inputs(dtype=torch.float32)
    h.requires_grad_(), w.requires_grad_()
    loss = linear_cross_entropy(h, w, y, label_smoothing=0.1, backend="triton")
    loss.backward(retain_graph=True)
    g1h, g1w = h.grad.clone(), w.grad.clone()
    loss.backward()
    assert torch.equal(h.grad - g1h, g1h) and torch.equal(w.grad - g1w, g1w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scale", [30.0, 300.0])
def test_entropy_at_large_logits_no_worse_than_torch_fp32(backend, scale):
    """|z| up to ~1.4e3: the op's entropy against fp64 is within torch's own fp32 error (plus 1e-6)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 24, generator=g) * scale
    w = torch.randn(301, 24, generator=g) / 5
    y = torch.randint(0, 301, (37,), generator=g)
    z = h.double() @ w.double().T
    lp = torch.log_softmax(z, -1)
    exact = -(lp.exp() * lp).sum(-1)
    lp32 = torch.log_softmax(h @ w.T, -1)
    torch_err = float(((-(lp32.exp() * lp32).sum(-1)).double() - exact).abs().max())
    _, stats = linear_cross_entropy(h, w, y, return_stats=True, backend=backend)
    assert float((stats.entropy.double() - exact).abs().max()) <= torch_err + 1e-6


# --------------------------------------------------------------------------------------------- the patch
def _tiny():
    from tiny_models import tiny_model

    return tiny_model("llama")


@pytest.mark.parametrize("call,exc,match", [
    (lambda m: apply_lsce_patch("meta-llama/Llama-3.2-1B"), TypeError, "must be a loaded transformers model"),
    (lambda m: apply_lsce_patch(42), TypeError, "must be a loaded transformers model"),
    (lambda m: apply_lsce_patch(torch.nn.Linear(2, 2)), TypeError, "causal LM with a .config"),
    (lambda m: apply_lsce_patch(m, label_smoothing="high"), TypeError, "label_smoothing must be None or a float"),
    (lambda m: apply_lsce_patch(m, label_smoothing=1.5), ValueError, "label_smoothing"),
    (lambda m: apply_lsce_patch(m, label_smoothing=float("nan")), ValueError, "label_smoothing"),
    (lambda m: apply_lsce_patch(m, label_smoothing=True), TypeError, "label_smoothing"),
    (lambda m: apply_lsce_patch(m, fused_eval_loss="yes"), TypeError, "fused_eval_loss"),
    (lambda m: apply_lsce_patch(model_type=3), TypeError, "model_type must be a string"),
    (lambda m: apply_lsce_patch(model_type="gpt2"), ValueError, "not in hf_lsce.s table of families"),
    (lambda m: apply_lsce_patch(m, model_type="gemma"), ValueError, "does not match"),
])
def test_patch_rejects_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call(_tiny())


def test_class_then_instance_patch_does_not_recurse_and_eval_loss_comes_first():
    """A script that patches its own model under `hf-lsce run` (class patch first): every forward works; the
    evaluation loss with smoothing and return_dict=False is first in the tuple, as HF orders it."""
    ref = _tiny().eval()
    apply_lsce_patch()
    model = _tiny().eval()
    apply_lsce_patch(model, label_smoothing=0.1)
    ids = torch.randint(3, 101, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        out = model(input_ids=ids, labels=ids, return_dict=False)
        expect = F.cross_entropy(ref(input_ids=ids).logits[:, :-1].reshape(-1, 101).float(), ids[:, 1:].reshape(-1),
                                 label_smoothing=0.1)
    assert isinstance(out, tuple) and out[0].dim() == 0 and torch.allclose(out[0], expect, rtol=1e-5)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # and training through it


# --------------------------------------------------------------------------------------------- calibration
def test_calibration_arguments_fail_at_construction_not_after_scoring():
    from hf_lsce.calibration import CalibrationCallback, MultipleChoiceItem, Task, calibration_metrics, score_task

    task = Task("t", "continuation", [MultipleChoiceItem("q", [" a", " b"], 0)])
    with pytest.raises(ValueError, match="n_bins"):
        CalibrationCallback([task], n_bins=0)
    with pytest.raises(ValueError, match="batch_size"):
        CalibrationCallback([task], batch_size=-1)
    with pytest.raises(ValueError, match="n_bins"):
        score_task(object(), object(), task, n_bins=0)  # before touching the (bogus) model
    with pytest.raises(ValueError, match="batch_size"):
        score_task(object(), object(), task, batch_size=0)
    with pytest.raises(TypeError, match="Task"):
        score_task(object(), object(), "mmlu")
    with pytest.raises(ValueError):
        calibration_metrics(torch.ones(0, 3), torch.ones(0, dtype=torch.long))
    with pytest.raises(ValueError, match="limit"):
        from hf_lsce.calibration import load_task

        load_task("mmlu", limit=0)


def test_data_files_with_bad_rows_name_file_line_and_field(tmp_path):
    from hf_lsce.calibration.tasks import DataFormatError, load_task

    def task_dir(name, files):
        d = tmp_path / name
        for rel, content in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(d)

    good = '{"ctx_a": "A man", "ctx_b": "is", "activity_label": "x", "endings": ["a", "b", "c", "d"], "label": 1}\n'
    cases = [
        ("mmlu", {"mmlu/test/x_test.csv": "q,a,b,c,d,A\nq2,a,b,C\n"}, r"x_test.csv: row 2 has 4 columns"),
        ("mmlu", {"mmlu/test/x_test.csv": "q,a,b,c,d,Z\n"}, r"row 1: field 'answer' = 'Z'"),
        ("hellaswag", {"hellaswag/hellaswag_val.jsonl": good.replace('["a", "b", "c", "d"]', '"abcd"')},
         r"line 1: field 'endings' must be a list of strings"),
        ("hellaswag", {"hellaswag/hellaswag_val.jsonl": good + good[:30]}, r"line 2 is not valid JSON"),
        ("hellaswag", {"hellaswag/hellaswag_val.jsonl": ""}, r"hellaswag_val.jsonl is empty"),
        ("hellaswag", {"hellaswag/hellaswag_val.jsonl": b"\xff\xfe" + good.encode()}, r"not UTF-8"),
        ("hellaswag", {"hellaswag/hellaswag_val.jsonl": good.replace('"label": 1', '"label": "B"')},
         r"line 1: field 'label' = 'B'"),
        ("hellaswag", {"hellaswag/hellaswag_val.jsonl": good.replace('"label": 1', '"label": 7')},
         r"points outside the 4 choices"),
        ("arc_easy", {"arc/arc_easy_test.jsonl": '{"query": "Q", "choices": "abc", "gold": 0}\n'},
         r"arc_easy_test.jsonl: line 1: field 'choices'"),
    ]
    for i, (name, files, match) in enumerate(cases):
        with pytest.raises(DataFormatError, match=match):
            load_task(name, task_dir(f"c{i}", files), shots=0)


def test_instruction_data_errors(tmp_path):
    from hf_lsce.data import load_instruction_records

    (tmp_path / "d.json").write_text('{"instruction": "x"}')
    with pytest.raises(ValueError, match=r"record 0 has fields \['instruction'\]"):
        load_instruction_records(str(tmp_path / "d.json"))
    (tmp_path / "e.jsonl").write_text('{"instruction": "x", "output": "y"}\n{"instr')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_instruction_records(str(tmp_path / "e.jsonl"))
    with pytest.raises(ValueError, match="limit"):
        load_instruction_records([{"prompt": "a", "completion": "b"}], limit=0)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_instruction_records(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="record 0 is a str"):
        load_instruction_records(["just text"])


# ---------------------------------------------------------------------------------------------------- ATS
def test_ats_bad_settings_and_a_base_of_another_architecture(tmp_path):
    from hf_lsce.ats import ATSCalibrator, ATSConfig
    from hf_lsce.ats.training import train_ats

    for bad in (dict(max_scale=float("inf")), dict(max_scale=float("nan")), dict(min_scale=0.0),
                dict(loss_alpha=2.0), dict(head_type="rnn")):
        with pytest.raises(ValueError):
            ATSConfig(**bad)
    base = _tiny()
    cal = ATSCalibrator.from_base(base, head_type="linear")
    cal.save_pretrained(tmp_path / "head")
    from tiny_models import tiny_model

    other = tiny_model("llama", num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # same D and V
    with pytest.raises(ValueError, match="num_attention_heads is 2, the head expects 4"):
        ATSCalibrator.from_pretrained(tmp_path / "head", base_model=other)
    recs = [{"prompt": "w1 w2", "completion": " w3"}] * 4
    from tiny_models import word_tokenizer

    tok = word_tokenizer()
    for bad, match in ((dict(num_train_epochs=0), "num_train_epochs"), (dict(max_steps=0), "max_steps"),
                       (dict(limit=0), "limit"), (dict(learning_rate=float("inf")), "learning_rate")):
        with pytest.raises(ValueError, match=match):
            train_ats(base, tok, recs, output_dir=str(tmp_path / "never"), **bad)
    assert not (tmp_path / "never").exists()


def test_fused_ats_loss_with_an_fp16_head_and_large_hidden_states():
    """fp16 tops out at 65504: hidden states of 1e4 times an inverse temperature of 10 overflowed to a NaN loss.
    The loss must equal the fp32 computation."""
    from hf_lsce.ats.loss import fused_selective_smoothing_loss

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(2, 6, 16, generator=g) * 1e4).half()
    w = (torch.randn(50, 16, generator=g) * 1e-3).half()
    s = torch.full((2, 6), 9.0)
    y = torch.randint(0, 50, (2, 6), generator=g)
    got = fused_selective_smoothing_loss(h, s, w, y)
    ref = fused_selective_smoothing_loss(h.float(), s, w.float(), y)
    assert torch.isfinite(got) and torch.allclose(got.float(), ref, rtol=1e-4)


# ----------------------------------------------------------------------------------------- the command line
def _user_files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def user_dir(tmp_path):
    """A folder that belongs to the user: a sharded model's files and notes."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "model-00001-of-00002.safetensors").write_bytes(b"shard one")
    (d / "model-00002-of-00002.safetensors").write_bytes(b"shard two")
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "notes.txt").write_text("do not lose")
    return d


def _cli_cases(user_dir, tmp_path, shared):
    alpaca = os.path.join(shared, "alpaca", "alpaca_en_demo.json") if shared else "/nonexistent.json"
    tiny_model_dir = tmp_path / "tinymodel"
    interrupted = tmp_path / "half"
    return [
        ["env", "--tokens", "0"],
        ["env", "--head", "64,-3"],
        ["env", "--device", "cuda:3"],
        ["eval", "--model", str(tmp_path / "nope"), "--tasks", "mmlu"],
        ["eval", "--model", "x", "--tasks", "mmlux"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--limit", "0"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--limit", "-5"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--limit", "mmlu=ten"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--limit", "arc_easy=5"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--shots", "-1"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--n-bins", "0"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--batch-size", "0"],
        ["eval", "--model", "x", "--tasks", "mmlu", "--data-dir", str(tmp_path / "nodata")],
        ["eval", "--model", "x", "--tasks", "mmlu", "--subjects", "basket_weaving", "--data-dir", shared or "/none"],
        ["eval", "--model", "x", "--tasks", "hellaswag", "--subjects", "a"],
        ["eval", "--model", str(tiny_model_dir), "--tasks", "arc_easy", "--limit", "2", "--data-dir",
         shared or "/none", "--output-dir", str(user_dir)],
        ["eval", "--model", str(interrupted), "--tasks", "arc_easy", "--data-dir", shared or "/none",
         "--output-dir", str(tmp_path / "ev2")],
        ["train-ats", "--model", "x", "--data", str(tmp_path / "missing.json")],
        ["train-ats", "--model", "x", "--data", alpaca, "--epochs", "0"],
        ["train-ats", "--model", "x", "--data", alpaca, "--lr", "-1"],
        ["train-ats", "--model", "x", "--data", alpaca, "--max-steps", "0"],
        ["train-ats", "--model", "x", "--data", alpaca, "--limit", "0"],
        ["train-ats", "--model", str(tiny_model_dir), "--data", alpaca, "--output-dir", str(user_dir)],
        ["train-ats", "--model", str(tiny_model_dir), "--data", alpaca, "--output-dir", str(tmp_path / "fresh"),
         "--resume"],
        ["diagnose", str(tmp_path / "nope")],
        ["diagnose", "x", "--label-smoothing", "7"],
        ["diagnose", "x", "--rho", "-1"],
        ["diagnose", str(tiny_model_dir), "--text-file", str(tmp_path / "missing.txt")],
        ["demo", "--label-smoothing", "0"],
        ["demo", "--steps", "0"],
        ["demo", "--budget", "huge"],
        ["demo", "--output-dir", str(user_dir), "--model", str(tiny_model_dir)],
        ["run", str(tmp_path / "no_script.py")],
        ["run", "-m", "no_such_module_xyz"],
        ["nonsense"],
    ]


def _shared():
    from conftest import SHARED_DATA

    return str(SHARED_DATA) if SHARED_DATA.is_dir() else None


def test_cli_user_mistakes_are_one_line_exit_2_and_touch_nothing(user_dir, tmp_path, capsys):
    """Each mistake: exit status 2, exactly one line on stderr, no traceback; afterwards every file under the
    test's folder (the user's model folder included) is byte-for-byte what it was, and no folder was left."""
    from hf_lsce.cli import main
    from hf_lsce.outputs import MARKER
    from tiny_models import word_tokenizer

    model = _tiny()
    model.save_pretrained(tmp_path / "tinymodel")
    word_tokenizer().save_pretrained(tmp_path / "tinymodel")
    half = tmp_path / "half"  # what an interrupted train-ats run leaves: a marker that never said complete
    half.mkdir()
    (half / "config.json").write_text((tmp_path / "tinymodel" / "config.json").read_text())
    (half / MARKER).write_text(json.dumps({"command": "train-ats", "status": "interrupted"}))
    before = _user_files(tmp_path)
    dirs_before = sorted(str(p) for p in tmp_path.rglob("*") if p.is_dir())
    capsys.readouterr()  # the set-up's own output
    for argv in _cli_cases(user_dir, tmp_path, _shared()):
        code = main(argv)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2, (argv, err)
        assert len(lines) == 1 and "Traceback" not in err, (argv, err)
    assert _user_files(tmp_path) == before
    assert sorted(str(p) for p in tmp_path.rglob("*") if p.is_dir()) == dirs_before


def test_interrupted_run_leaves_nothing_trusted_and_resume_is_offered(tmp_path):
    """A run that fails inside a folder it created removes the folder; inside an existing hf_lsce folder it marks
    the run unfinished, and loaders refuse it until it is resumed or re-run."""
    from hf_lsce.outputs import OutputFolderError, output_folder, read_marker, require_complete

    with pytest.raises(KeyboardInterrupt):
        with output_folder(tmp_path / "new", command="eval"):
            (tmp_path / "new" / "partial.json").write_text("{")
            raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()
    with output_folder(tmp_path / "ats", command="train-ats"):
        (tmp_path / "ats" / "checkpoint-2").mkdir()
    with pytest.raises(RuntimeError):
        with output_folder(tmp_path / "ats", command="train-ats", overwrite=True):
            raise RuntimeError("out of memory")
    assert read_marker(tmp_path / "ats")["status"] == "failed"
    with pytest.raises(ValueError, match="unfinished"):
        require_complete(tmp_path / "ats")
    with pytest.raises(OutputFolderError, match="--resume to continue it"):
        with output_folder(tmp_path / "ats", command="train-ats"):
            pass
    with output_folder(tmp_path / "ats", command="train-ats", resume=True):
        pass
    require_complete(tmp_path / "ats")


@pytest.mark.parametrize("b", [0.0, 0.1])
def test_patched_eval_forward_with_labels_beyond_the_vocabulary(b):
    """Evaluation (not fused) with a label >= V: a ValueError naming labels and the fix, not torch's IndexError."""
    from hf_lsce import apply_lsce_patch, revert_lsce_patch
    from tiny_models import tiny_model

    model = apply_lsce_patch(tiny_model("llama"), label_smoothing=b).eval()
    try:
        ids = torch.randint(0, 10, (2, 6))
        labels = ids.clone()
        labels[1, 3] = model.config.vocab_size + 5
        with pytest.raises(ValueError, match=r"labels must be in \[0, .*tokenizer"):
            model(input_ids=ids, labels=labels)
        labels[1, 3] = -100
        assert torch.isfinite(model(input_ids=ids, labels=labels).loss)
    finally:
        revert_lsce_patch(model)


def test_nll_eps_must_be_a_probability():
    from hf_lsce.calibration.metrics import negative_log_likelihood

    p = torch.tensor([[0.7, 0.3], [0.2, 0.8]])
    for eps in (0, -1e-3, 1.5, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            negative_log_likelihood(p, [0, 1], eps=eps)


def test_string_labels_name_labels():
    from hf_lsce.calibration.metrics import calibration_metrics

    with pytest.raises(TypeError, match=r"`labels` must be integer class indices.*Map answer strings"):
        calibration_metrics(torch.tensor([[0.7, 0.3], [0.2, 0.8]]), ["A", "B"])


@pytest.mark.parametrize("broken", ["config.json", "model.safetensors"])
def test_truncated_model_folder_names_the_file(tmp_path, broken):
    """A model folder whose config.json or weights file was cut short: a ValueError naming that file and the fix."""
    from hf_lsce.checkpoints import load_model_and_tokenizer
    from tiny_models import tiny_model

    tiny_model("llama").save_pretrained(tmp_path)
    f = tmp_path / broken
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{broken}.*truncated or corrupt.*again"):
        load_model_and_tokenizer(str(tmp_path))


@pytest.mark.parametrize("broken", ["config.json", "model.safetensors"])
@pytest.mark.parametrize("command", [["eval", "--model", "{m}", "--tasks", "arc_easy"], ["diagnose", "{m}"],
                                     ["sweep", "--model", "{m}", "--budget", "tiny"],
                                     ["demo", "--model", "{m}", "--tiny"],
                                     ["train-ats", "--model", "{m}", "--data", "trivia_qa"]])
def test_every_command_names_a_truncated_model_file(tmp_path, broken, command, capsys):
    """Every command loads models through the one loader: a truncated file exits 2 with one line naming it and the
    fix (transformers' own messages, "Unterminated string starting at: line 3 column 5" or "incomplete metadata",
    name no file)."""
    from hf_lsce.cli import main
    from tiny_models import save_checkpoint

    model = save_checkpoint(tmp_path / "m")
    capsys.readouterr()  # (saving prints progress)
    f = model / broken
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    argv = [a.format(m=model) for a in command] + (["--output-dir", str(tmp_path / "out")]
                                                  if command[0] in ("sweep", "demo", "train-ats") else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "truncated or corrupt" in err[0] and "again" in err[0], err
