"""Liger-Kernel's other kernels beside the patch (``hf_lsce.patching.liger``), through the switches users set:
``use_liger_kernel=True`` in the Trainer's and TRL's arguments (patch before or after the Trainer is built, instance
and class patch), ``apply_lsce_patch(liger_kernels=...)``, and the refusals. Liger's Triton kernels need a GPU (its
RMSNorm kernel does not run in Triton's interpreter), so what these CPU tests read is what the Trainer put on the
model when training started (Liger's own module classes, hf_lsce's forward), with the real liger-kernel; a step runs
here with Liger's module kernels switched off through its own configuration, and benchmarks/bench_trainer.py runs the
whole step on a GPU."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_lsce import apply_lsce_patch, revert_lsce_patch
from hf_lsce.patching import liger, versions
from hf_lsce.patching.forward import is_ours
from hf_lsce.patching.trainer import LsceNotEngagedError

from tiny_models import V, tiny_model

pytest.importorskip("liger_kernel")


@pytest.fixture(autouse=True)
def _clean():
    import transformers.models.llama.modeling_llama as llama

    saved = {k: getattr(llama, k) for k in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")}
    yield
    revert_lsce_patch()
    for k, v in saved.items():  # (a class patch of Liger's replaces the family's module classes)
        setattr(llama, k, v)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n=4, t=9):
        g = torch.Generator().manual_seed(0)
        self.rows = [dict(input_ids=(ids := torch.randint(0, V, (t,), generator=g)), labels=ids.clone())
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class _Seen(Exception):
    pass


class _Look(TrainerCallback):
    """At the start of training (after the Trainer applied Liger, whichever version): what the model is made of;
    then stop, before a step runs Liger's GPU kernels."""

    def __init__(self, stop=True):
        self.seen, self.stop = {}, stop

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.seen = dict(norm=type(model.model.norm).__name__ if hasattr(model, "model") else None,
                         norm_forward=getattr(model.model.norm.forward, "__qualname__", ""),
                         mlp_forward=getattr(model.model.layers[0].mlp.forward, "__qualname__", ""),
                         forward_ours=is_ours(model.forward))
        if self.stop:
            raise _Seen


def _args(tmp_path, **kw):
    kw = dict(dict(label_smoothing_factor=0.1, use_liger_kernel=True), **kw)
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to=[],
                             save_strategy="no", use_cpu=True, **kw)


def _train_to_start(trainer, look):
    trainer.add_callback(look)
    with pytest.raises(_Seen):
        trainer.train()
    return look.seen


@pytest.mark.parametrize("order", ["patch, then Trainer", "Trainer, then patch", "class patch"])
def test_use_liger_kernel_puts_its_kernels_beside_the_patched_loss(tmp_path, order):
    """use_liger_kernel=True with the patch: Liger's RMSNorm and SwiGLU on the model, its fused loss not (the forward
    is hf_lsce's), in either order and with the class patch of ``hf-lsce run``; the user's arguments unchanged."""
    if order == "class patch":
        apply_lsce_patch()
    model = tiny_model("llama")
    if order == "patch, then Trainer":
        apply_lsce_patch(model)
    args = _args(tmp_path)
    trainer = Trainer(model=model, args=args, train_dataset=_Rows())
    if order == "Trainer, then patch":
        apply_lsce_patch(model)
    seen = _train_to_start(trainer, _Look())
    assert seen["norm_forward"].startswith("LigerRMSNorm") and seen["mlp_forward"].startswith("LigerSwiGLUMLP"), seen
    assert seen["forward_ours"], seen
    assert args.liger_kernel_config is None  # (the Trainer holds a copy with Liger's loss kernels off)
    assert trainer.args.liger_kernel_config == {"fused_linear_cross_entropy": False, "cross_entropy": False}


def test_unpatched_model_keeps_ligers_own_loss(tmp_path):
    """Without the patch nothing changes: the Trainer applies Liger's fused loss as it always did (its forward)."""
    model = tiny_model("llama")
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Rows())
    seen = _train_to_start(trainer, _Look())
    assert not seen["forward_ours"] and trainer.args.liger_kernel_config is None


def test_a_step_with_liger_switched_on_is_hf_lsces_loss(tmp_path):
    """A whole Trainer step with use_liger_kernel=True (Liger's module kernels off through its own configuration: they
    need a GPU) runs through the fused op, and its update equals the same step without Liger's switch."""
    base = tiny_model("llama")
    updates = []
    for flag in (True, False):
        model = apply_lsce_patch(copy.deepcopy(base))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = _args(tmp_path / str(flag), learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                     max_grad_norm=0.0, use_liger_kernel=flag,
                     liger_kernel_config=dict(rope=False, rms_norm=False, swiglu=False) if flag else None)
        Trainer(model=model, args=args, train_dataset=_Rows()).train()
        updates.append({n: before[n] - p.detach() for n, p in model.named_parameters()})
    for n, d in updates[1].items():
        assert torch.allclose(updates[0][n], d, atol=1e-6), n


def test_ligers_loss_asked_for_beside_the_patch_is_refused(tmp_path):
    """liger_kernel_config asking for Liger's fused loss with a patched model: refused when the Trainer is built, in
    one line saying which loss would run."""
    model = apply_lsce_patch(tiny_model("llama"))
    args = _args(tmp_path, liger_kernel_config={"fused_linear_cross_entropy": True})
    with pytest.raises(ValueError, match=r"^liger_kernel_config asks for Liger-Kernel's own loss "
                                         r"\(fused_linear_cross_entropy=True\) beside hf_lsce's patch: hf_lsce's fused "
                                         r"label-smoothed loss runs"):
        Trainer(model=model, args=args, train_dataset=_Rows())


@pytest.mark.parametrize("found, ok", [("0.8.1", True), ("0.8.9", True), ("0.7.0", False), ("0.9.0", False)])
def test_liger_outside_the_tested_range_is_refused_in_one_line(tmp_path, monkeypatch, found, ok):
    real = versions.installed_version
    monkeypatch.setattr(liger, "installed_version", lambda n: found if n == "liger-kernel" else real(n))
    model = apply_lsce_patch(tiny_model("llama"))
    if ok:
        Trainer(model=model, args=_args(tmp_path), train_dataset=_Rows())
        return
    with pytest.raises(ValueError, match=rf"^use_liger_kernel: hf_lsce runs beside liger-kernel 0\.8\.1 to 0\.8\.5, "
                                         rf"found {found}: pip install"):
        Trainer(model=model, args=_args(tmp_path), train_dataset=_Rows())


def test_without_liger_installed_the_trainers_own_error(tmp_path, monkeypatch):
    """use_liger_kernel=True without liger-kernel: the Trainer's own ImportError, unchanged by the patch."""
    import transformers.integrations.liger as hf_liger

    monkeypatch.setattr(liger, "installed_version", lambda n: None)
    monkeypatch.setattr(hf_liger, "is_liger_kernel_available", lambda: False)
    model = apply_lsce_patch(tiny_model("llama"))
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Rows())
    with pytest.raises(ImportError, match="You have set `use_liger_kernel` to `True` but liger-kernel"):
        trainer.train()


def test_a_forward_liger_replaced_stops_the_first_step_even_at_b0(tmp_path):
    """A family whose forward Liger replaces (rather than its modules) would train with Liger's loss: the step check
    names the forward that ran and stops the run before the first optimizer step, whatever b."""
    model = apply_lsce_patch(tiny_model("llama"))
    stock = type(model).forward

    def lce_forward(self, input_ids=None, labels=None, **k):  # what such a family's Liger patch leaves: its forward
        return stock(self, input_ids=input_ids, labels=labels, **k)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.forward = lce_forward.__get__(model)
    args = _args(tmp_path, label_smoothing_factor=0.0, liger_kernel_config=dict(rope=False, rms_norm=False,
                                                                                   swiglu=False))
    with pytest.raises(LsceNotEngagedError, match="the model's forward is lce_forward .*test_liger.py"):
        Trainer(model=model, args=args, train_dataset=_Rows()).train()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_apply_lsce_patch_liger_kernels_argument():
    """Outside a Trainer: apply_lsce_patch(model, liger_kernels=True) (a dict: Liger's switches) puts Liger's kernels
    on the instance beside the patched forward; bad values are refused naming the argument; a family Liger has no
    kernels for is patched alone, with one log line."""
    model = apply_lsce_patch(tiny_model("llama"), liger_kernels={"swiglu": False})
    assert model.model.norm.forward.__qualname__.startswith("LigerRMSNorm") and is_ours(model.forward)
    assert not model.model.layers[0].mlp.forward.__qualname__.startswith("Liger")
    with pytest.raises(TypeError, match="^liger_kernels must be True, False or a dict"):
        apply_lsce_patch(tiny_model("llama"), liger_kernels="yes")
    with pytest.raises(ValueError, match=r"^apply_lsce_patch\(liger_kernels=...\) asks for Liger-Kernel's own loss"):
        apply_lsce_patch(tiny_model("llama"), liger_kernels={"cross_entropy": True})
    assert liger.apply_liger_kernels(tiny_model("starcoder2"), where="test") == []


def test_skip_logits_in_evaluation_gives_the_smoothed_loss_without_logits():
    """The Trainer's evaluation with use_liger_kernel and prediction_loss_only passes Liger's ``skip_logits=True``: the
    patched forward computes the loss through the op (no logits) and it equals HF's LabelSmoother on the model's own
    logits."""
    from transformers.trainer_pt_utils import LabelSmoother

    model = tiny_model("llama").eval()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :2] = -100
    with torch.no_grad():
        want = LabelSmoother(epsilon=0.1)(model(input_ids=ids), labels, shift_labels=True)
        apply_lsce_patch(model, label_smoothing=0.1)
        out = model(input_ids=ids, labels=labels, skip_logits=True)
    assert out.logits is None
    assert torch.allclose(out.loss, want, rtol=1e-5), (float(out.loss), float(want))
