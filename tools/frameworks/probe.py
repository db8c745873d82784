"""In-process probe for the framework end-to-end runs (tools/frameworks_e2e.py): on the trainer a framework builds,
it records every training loss at full precision (not the 4-digit log), the lm_head calls that returned logits,
hf_lsce's engagement, each step's time and tokens and the device's peak memory, and writes them to $LSCE_PROBE_OUT as
JSON when training ends (``$LSCE_PROBE_OUT.rankR`` per rank under several processes). A test harness, not part of the
package: the frameworks reach it through their own hooks (Axolotl: a plugin; LLaMA-Factory: its Trainer's train).

``LSCE_PROBE_HF_SMOOTHING=b`` gives the trainer transformers' ``LabelSmoother(epsilon=b)``, what
``label_smoothing_factor: b`` does in the HF Trainer: the stock smoothed reference where a framework's config has no
such key (Axolotl drops it)."""
from __future__ import annotations

import json
import os
import time

import torch
from transformers import Trainer


# the distributions whose versions each record names (what ran where: docs/frameworks.md's versions table)
VERSIONED = ("torch", "triton", "transformers", "accelerate", "peft", "trl", "bitsandbytes", "liger-kernel",
             "deepspeed", "axolotl", "llamafactory", "hf-lsce")


class _Timer:
    """Each optimizer step's wall time (the device synchronised at its start and end), the input tokens it trained
    on (the attention mask's ones, or every position of a packed batch), and the device's peak memory over training:
    synchronising at step boundaries only adds no wait inside a step."""

    def __init__(self, record: dict):
        self.record = record
        self.t0 = None
        self.tokens = 0

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def count(self, inputs) -> None:
        mask = inputs.get("attention_mask") if hasattr(inputs, "get") else None
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if torch.is_tensor(mask) and mask.dim() == 2:
            self.tokens += int(mask.sum())
        elif torch.is_tensor(ids):
            self.tokens += ids.numel()

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class StepTimer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()

            def on_step_begin(self, args, state, control, **kw):
                timer._sync()
                timer.t0, timer.tokens = time.perf_counter(), 0

            def on_step_end(self, args, state, control, **kw):
                timer._sync()
                timer.record["step_seconds"].append(time.perf_counter() - timer.t0)
                timer.record["step_tokens"].append(timer.tokens)
                if torch.cuda.is_available():  # (a framework may reset the peak during training: the largest seen)
                    timer.record["peak_gib"] = max(timer.record["peak_gib"] or 0.0,
                                                   torch.cuda.max_memory_allocated() / 2**30)

            def on_train_end(self, args, state, control, **kw):
                if torch.cuda.is_available():
                    timer.record["peak_gib"] = max(timer.record["peak_gib"] or 0.0,
                                                   torch.cuda.max_memory_allocated() / 2**30)
                    timer.record["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                    timer.record["device"] = torch.cuda.get_device_name()

        return StepTimer()


def versions() -> dict:
    """The installed version of each of VERSIONED that is installed, and the NCCL torch loaded (on a GPU)."""
    from importlib import metadata

    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def install(trainer) -> None:
    record = dict(versions=versions(), losses=[], lm_head_logit_calls=0, fused_calls=None, patched=False, confirmed=False,
                  step_seconds=[], step_tokens=[], step_label_tokens=[], peak_gib=None)
    timer = _Timer(record)
    trainer.add_callback(timer.callback())
    hf_b = float(os.environ.get("LSCE_PROBE_HF_SMOOTHING") or 0)
    if hf_b > 0:
        from transformers.trainer_pt_utils import LabelSmoother

        trainer.label_smoother = LabelSmoother(epsilon=hf_b)
    record["hf_label_smoother"] = hf_b
    record["average_tokens_across_devices"] = getattr(trainer.args, "average_tokens_across_devices", None)
    head = trainer.model.get_output_embeddings() if hasattr(trainer.model, "get_output_embeddings") else None

    def on_head(module, args, out):
        # logits: a tensor whose last dimension is the vocabulary (under ZeRO-3 and FSDP2 the patch runs the op as
        # the head's own forward, so that the engine gathers the weight: that call returns the loss, not logits)
        vocab = getattr(module, "out_features", None)
        if torch.is_tensor(out) and out.dim() >= 2 and (vocab is None or out.shape[-1] == vocab):
            record["lm_head_logit_calls"] += 1

    if head is not None:
        head.register_forward_hook(on_head)
    compute_loss = trainer.compute_loss

    def probed(model, inputs, *args, **kwargs):
        if model.training:
            timer.count(inputs)
            labels = inputs.get("labels") if hasattr(inputs, "get") else None
            if torch.is_tensor(labels):  # the labels the shifted loss scores (each rank's own count)
                record["step_label_tokens"].append(int((labels[..., 1:] != -100).sum()))
        out = compute_loss(model, inputs, *args, **kwargs)
        loss = out[0] if isinstance(out, tuple) else out
        if model.training:
            record["losses"].append(float(loss.detach()))
        return out

    trainer.compute_loss = probed
    train = trainer.train

    def probed_train(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        finally:
            try:
                from hf_lsce.patching import ENGAGEMENT, is_patched

                record.update(fused_calls=ENGAGEMENT.fused_calls, patched=is_patched(trainer.model),
                              confirmed=bool(getattr(trainer, "_lsce_confirmed", False)))
            except ImportError:
                pass
            record["log_history"] = trainer.state.log_history  # (what report_to and the logs were given)
            out = os.environ["LSCE_PROBE_OUT"]
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                out, record["rank"] = f"{out}.rank{os.environ.get('RANK', '0')}", int(os.environ.get("RANK", "0"))
            with open(out, "w") as f:
                json.dump(record, f)

    trainer.train = probed_train


def install_on_every_trainer() -> None:
    """Probe each Trainer when its train() is called (LLaMA-Factory builds and trains its own)."""
    original = Trainer.train

    def train(self, *args, **kwargs):
        if not getattr(self, "_lsce_probed", False):
            self._lsce_probed = True
            install(self)
            return self.train(*args, **kwargs)
        return original(self, *args, **kwargs)

    Trainer.train = train


try:  # Axolotl: plugins: [..., probe.ProbePlugin]
    from axolotl.integrations.base import BasePlugin

    class ProbePlugin(BasePlugin):
        def post_trainer_create(self, cfg, trainer):
            install(trainer)
except ImportError:
    pass
