"""Multi-process checks on CPU (gloo): the vocabulary-parallel op, and DDP training with the patch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"


def _torchrun(script, *args, nproc=2, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                          str(SCRIPTS / script), *map(str, args)], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel_op_matches_unsharded_fp64(tmp_path, backend):
    """2 ranks, uneven shards (19 + 18 of 37): loss, dh, dW shard and db equal the fp64 full-vocabulary oracle
    for smoothing 0 / 0.1 / per-token, soft-cap, bias, ignore_index, every reduction, num_items_in_batch, and
    bf16 / fp16 with a bias (within their rounding). The triton backend runs the kernels in Triton's interpreter."""
    _torchrun("vocab_parallel.py", tmp_path / "out", backend)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"out.{rank}").read_text())
        assert any("bf16" in r["case"] for r in results)
        for r in results:
            assert max(r["loss"], r["dh"], r["dw"], r["db"]) < r["tol"], r


def test_vocab_parallel_needs_an_initialised_group():
    from hf_lsce import linear_cross_entropy

    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(ValueError, match="init_process_group"):
        linear_cross_entropy(h, w, y, process_group=object())


def _step(tmp_path, name, patch, per_device, accum, nproc=1, kind="trainer"):
    out = tmp_path / name
    if nproc == 1:
        env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
        res = subprocess.run([sys.executable, str(SCRIPTS / "ddp_train.py"), str(out), str(int(patch)), str(per_device),
                              str(accum), "cpu", kind], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
    else:
        _torchrun("ddp_train.py", out, int(patch), per_device, accum, "cpu", kind, nproc=nproc)
    return torch.load(out / "state.pt"), torch.load(out / "log.pt")[0]["loss"]


def _moved(state):
    """Largest relative change of ``state`` from the scripts' initial model (same seed and config)."""
    import transformers

    torch.manual_seed(0)
    fresh = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True)).state_dict()
    return max(float((state[k] - fresh[k]).norm() / fresh[k].norm()) for k in state)


def test_ddp_trainer_step_equals_single_process_hf(tmp_path):
    """Trainer + DDP (2 gloo ranks) + gradient accumulation + tied embeddings, label_smoothing_factor=0.1, through
    the patch: one SGD step gives the same weights and loss as one unpatched process (HF's LabelSmoother) on the
    same 8 sequences, whose label counts differ (so only exact num_items_in_batch handling agrees)."""
    ref, ref_loss = _step(tmp_path, "hf", False, 4, 2)
    assert _moved(ref) > 1e-3  # the step is large enough for a mis-weighted loss to show
    for name, per_device, accum, nproc in (("patched", 4, 2, 1), ("ddp", 2, 2, 2)):
        state, loss = _step(tmp_path, name, True, per_device, accum, nproc)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        diff = max(float((state[k] - ref[k]).norm() / ref[k].norm()) for k in ref)
        assert diff < 1e-6, (name, diff)


def test_fsdp2_sharded_lm_head_gradients_equal_unsharded_hf(tmp_path):
    """FSDP2 fully_shard over 2 gloo ranks on a patched Llama: the gathered gradients of every parameter equal an
    unsharded, unpatched model's on the whole batch (materialised smoothed loss), with tied embeddings and the head
    in the root unit, and with an untied head wrapped as its own FSDP unit (all-gathered around the op by its hooks)."""
    _torchrun("fsdp2_step.py", tmp_path / "fsdp.json")
    out = json.loads((tmp_path / "fsdp.json").read_text())
    assert out["separate_head"]["head_cls"] == "FSDPLinear"
    for layout, r in out.items():
        assert r["cls"] == "FSDPLlamaForCausalLM"
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), layout
        assert r["max_rel_grad_diff"] < 1e-5, (layout, r)


def test_ddp_sft_trainer_step_equals_single_process_hf(tmp_path):
    """TRL's SFTTrainer (completion-only loss, completions of 1-7 tokens) with label_smoothing_factor=0.1 through
    the patch, DDP over 2 gloo ranks with gradient accumulation: the same step as one unpatched process, whose
    SFTTrainer smooths with HF's LabelSmoother on the logits (num_items_in_batch-aware since transformers 5.15)."""
    ref, ref_loss = _step(tmp_path, "sft_hf", False, 4, 2, kind="sft")
    assert _moved(ref) > 1e-3
    state, loss = _step(tmp_path, "sft_ddp", True, 2, 2, nproc=2, kind="sft")
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    diff = max(float((state[k] - ref[k]).norm() / ref[k].norm()) for k in ref)
    assert diff < 1e-6, diff
