"""In-process probe for the framework end-to-end runs (tools/frameworks_e2e.py): on the trainer a framework builds,
it records every training compute_loss's loss (full precision, not the 4-digit log), the lm_head calls that returned
logits, and hf_lsce's engagement count, and writes them to $LSCE_PROBE_OUT as JSON when training ends (one file per
rank, ``$LSCE_PROBE_OUT.rankR``, when several processes train). A test harness, not part of the package: the
frameworks reach it through their own hooks (Axolotl: a plugin; LLaMA-Factory: its Trainer's train).

``LSCE_PROBE_HF_SMOOTHING=b`` (b > 0) gives the trainer transformers' own ``LabelSmoother(epsilon=b)``, which is what
``label_smoothing_factor: b`` does in the HF Trainer (logits, then smoothing on them): the stock smoothed reference for
a framework whose config has no such key (Axolotl drops it).

``LSCE_PROBE_PROFILE=FILE`` profiles optimizer steps 7 to 9 (torch.profiler, CPU and CUDA) and writes FILE: the
profiled steps' wall time, the device's busy time, the kernels launched, and the operators by self CPU time and by self
CUDA time (where a host-bound step's time goes). ``LSCE_PROBE_PROFILE_STEPS=A,B`` profiles steps A+1 to B instead.
Under several processes rank 0 alone profiles.

``LSCE_PROBE_NO_CUDNN_ATTENTION=1`` turns off cuDNN's scaled-dot-product attention (``torch.backends.cuda.
enable_cudnn_sdp(False)``; SDPA then takes its flash or memory-efficient kernels) for every variant alike: on the GPU
image's torch it builds a graph on the host for each sequence length it has not met, which stalled single steps for
1 to 5 s (profiled: ``aten::_cudnn_attention_forward``, 3.4 s of host time in three steps), and it takes 2.6 to
4.2 ms of host time a call where nothing stalls."""
from __future__ import annotations

import json
import os
import time

import torch
from transformers import Trainer


# the distributions whose versions each record names (what ran where: docs/frameworks.md's versions table)
VERSIONED = ("torch", "triton", "transformers", "accelerate", "peft", "trl", "bitsandbytes", "liger-kernel",
             "deepspeed", "axolotl", "llamafactory", "hf-lsce")
PROFILE_STEPS = (6, 9)  # profiled: from the start of the step after global step 6 to the end of step 9 (3 steps)


def profile_steps() -> tuple[int, int]:
    """The global steps the profile starts after and ends at: ``LSCE_PROBE_PROFILE_STEPS=A,B`` or PROFILE_STEPS."""
    text = os.environ.get("LSCE_PROBE_PROFILE_STEPS")
    if not text:
        return PROFILE_STEPS
    a, b = (int(x) for x in text.split(","))
    if not 0 <= a < b:
        raise ValueError(f"LSCE_PROBE_PROFILE_STEPS={text!r}: give A,B with 0 <= A < B (steps A+1 to B are profiled)")
    return a, b


def _start_profiler():
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=acts)
    prof.start()
    return prof


def _write_profile(prof, wall_s: float, out: str, steps: int) -> None:
    prof.stop()
    ev = prof.key_averages()
    cuda_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in ev)
    launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                     "cuLaunchKernelEx"))
    head = (f"{steps} steps: wall {wall_s / steps * 1e3:.1f} ms/step, device busy {cuda_us / steps / 1e3:.1f} ms/step "
            f"(self CUDA time summed), kernel launches {launches / steps:.0f}/step\n\n")
    by_cpu = ev.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    by_cuda = ev.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=70)
    with open(out, "w") as f:
        f.write(head + "By self CPU time:\n" + by_cpu + "\nBy self CUDA time:\n" + by_cuda)


class _Timer:
    """Each optimizer step's wall time (the device synchronised at its start and end), the input tokens it trained
    on (the attention mask's ones, or every position of a packed batch), and the device's peak memory over training:
    the figures of tools/frameworks_gpu.py. Synchronising at step boundaries only adds no wait inside a step."""

    def __init__(self, record: dict):
        self.record = record
        self.t0 = None
        self.tokens = 0
        rank0 = os.environ.get("RANK", "0") == "0"
        self.profile_out = os.environ.get("LSCE_PROBE_PROFILE") if rank0 else None
        self.profile_steps = profile_steps()
        self.prof = self.prof_t0 = None

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
                if timer.profile_out and state.global_step == timer.profile_steps[0] and timer.prof is None:
                    timer.prof = _start_profiler()
                    timer.prof_t0 = time.perf_counter()
                timer.t0, timer.tokens = time.perf_counter(), 0

            def on_step_end(self, args, state, control, **kw):
                timer._sync()
                timer.record["step_seconds"].append(time.perf_counter() - timer.t0)
                timer.record["step_tokens"].append(timer.tokens)
                if torch.cuda.is_available():  # (a framework may reset the peak during training: the largest seen)
                    timer.record["peak_gib"] = max(timer.record["peak_gib"] or 0.0,
                                                   torch.cuda.max_memory_allocated() / 2**30)
                first, last = timer.profile_steps
                if timer.prof is not None and state.global_step == last:
                    _write_profile(timer.prof, time.perf_counter() - timer.prof_t0, timer.profile_out, last - first)
                    timer.prof = None

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
    if os.environ.get("LSCE_PROBE_NO_CUDNN_ATTENTION") == "1":
        torch.backends.cuda.enable_cudnn_sdp(False)
    record["cudnn_attention"] = torch.backends.cuda.cudnn_sdp_enabled()
    trainer.add_callback(timer.callback())
    hf_b = float(os.environ.get("LSCE_PROBE_HF_SMOOTHING") or 0)
    if hf_b > 0:
        from transformers.trainer_pt_utils import LabelSmoother

        trainer.label_smoother = LabelSmoother(epsilon=hf_b)
    record["hf_label_smoother"] = hf_b
    # (how the Trainer normalises each rank's loss: tools/frameworks_gpu.py's judge_multi)
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
