"""Multi-process checks on CPU (gloo): the vocabulary-parallel op, and training through the patch under every engine
that runs on CPU (DDP, FSDP2's fully_shard, DeepSpeed ZeRO-1/2/3), each against one unpatched fp32 process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"


def _torchrun(script, *args, nproc=2, timeout=600):
    """tests/scripts/SCRIPT on CPU under torchrun with nproc gloo ranks, or in one plain process (nproc=0)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    launcher = [] if nproc == 0 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    res = subprocess.run([sys.executable, *launcher, str(SCRIPTS / script), *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=timeout)
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


def run_engine(out, *args, nproc=0):
    """tests/scripts/engine_step.py in one plain process (nproc=0) or under torchrun; (result, state or None)."""
    _torchrun("engine_step.py", out, *args, nproc=nproc)
    result = json.loads((Path(out) / "result.json").read_text())
    state = torch.load(Path(out) / "state.pt") if (Path(out) / "state.pt").exists() else None
    return result, state


def _rel(state, ref):
    """Largest relative difference of any weight."""
    return max(float((state[k] - ref[k]).norm() / ref[k].norm()) for k in ref)


STEP = ("--steps", 2, "--per-device", 2, "--accum", 2)  # 2 ranks x 2 rows x 2 micro-batches, 2 optimizer steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One unpatched process in fp32 on the same global batches (4 rows x 2 micro-batches, 2 steps): HF's own
    smoothed loss from full logits, Trainer and SFTTrainer."""
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for kind in ("trainer", "sft"):
        result, state = run_engine(root / kind, "--patch", 0, "--trainer", kind, "--steps", 2, "--per-device", 4,
                                   "--accum", 2)
        assert result["full_logit_calls"] > 0 and result["fused_calls"] == 0 and result["error"] is None
        out[kind] = (result, state)
    return out


def _check_engaged_and_equal(result, state, reference, tol):
    ref_result, ref_state = reference
    assert result["error"] is None, result["error"]
    assert result["full_logit_calls"] == 0, result  # no lm_head call returned the N x V logits
    assert result["fused_calls"] >= 8, result  # every micro-batch of every rank ran through the op
    assert result["loss_dtypes"] == ["float32"], result
    assert result["losses"] == pytest.approx(ref_result["losses"], rel=tol), result["losses"]
    return _rel(state, ref_state)


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_ddp_step_equals_single_process_fp32(tmp_path, reference, kind):
    """Trainer / TRL SFTTrainer (completion-only loss, completions of different lengths) + DDP over 2 gloo ranks +
    gradient accumulation + tied embeddings, label_smoothing_factor=0.1, through the patch: two SGD steps give the
    losses and weights of one unpatched fp32 process (HF's smoothing on full logits) on the same sequences, whose
    label counts differ, so only exact num_items_in_batch handling agrees."""
    result, state = run_engine(tmp_path / "ddp", "--engine", "ddp", "--trainer", kind, *STEP, nproc=2)
    assert _check_engaged_and_equal(result, state, reference[kind], 1e-5) < 1e-6
    assert _rel(reference[kind][1], _initial_state()) > 1e-3  # the steps are large enough for a wrong loss to show


def _initial_state():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=True)).state_dict()


def test_fsdp2_sharded_lm_head_gradients_equal_unsharded_hf(tmp_path):
    """FSDP2 fully_shard over 2 gloo ranks on a patched Llama: the gathered gradients of every parameter equal an
    unsharded, unpatched model's on the whole batch (materialised smoothed loss), with tied embeddings and the head
    in the root unit, and with an untied head wrapped as its own FSDP unit (all-gathered around the op by its hooks).
    In accelerate's layout and bf16 policy (what the Trainer's FSDP2 auto-wrap builds: the head in a tail unit, every
    unit's outputs cast to bf16) the loss still reaches the caller in fp32, equal to the bf16 model's materialised
    loss, not rounded to bf16 (4.125 where it is 4.1387). accelerate enables FSDP only on GPUs, so the Trainer's own
    FSDP2 path is checked on 2 GPUs (benchmarks/distributed_matrix.py)."""
    _torchrun("fsdp2_step.py", tmp_path / "fsdp.json")
    out = json.loads((tmp_path / "fsdp.json").read_text())
    assert out["separate_head"]["head_cls"] == "FSDPLinear"
    for layout, r in out.items():
        assert r["cls"] == "FSDPLlamaForCausalLM"
        assert r["loss_dtype"] == "torch.float32", layout
        if layout.startswith("accelerate_bf16"):
            assert r["head_cls"] == "FSDPLinear"
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=5e-5), layout  # bf16's step here is 8e-3
            assert r["max_rel_grad_diff"] < 3e-2, (layout, r)  # bf16 parameters and reductions
        else:
            assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), layout
            assert r["max_rel_grad_diff"] < 1e-5, (layout, r)


def _need_deepspeed():
    if os.environ.get("CI"):  # CI installs the deepspeed extra: a missing one must fail, not skip
        import deepspeed  # noqa: F401
    else:
        pytest.importorskip("deepspeed")


@pytest.mark.parametrize("engine,kind", [("zero1", "trainer"), ("zero2", "trainer"), ("zero3", "trainer"),
                                         ("zero3", "sft")])
def test_deepspeed_step_engages_and_equals_single_process_fp32(tmp_path, reference, engine, kind):
    """DeepSpeed ZeRO-1/2/3 through the Trainer's deepspeed= argument (and ZeRO-3 through TRL's SFTTrainer), 2 gloo
    ranks on CPU, fp32: the model reaches compute_loss inside a DeepSpeedEngine, the ZeRO-3-partitioned head weight is
    gathered for the op and its gradient partitioned back. No lm_head call returns logits, every micro-batch runs the
    fused op, and losses and weights equal one unpatched fp32 process."""
    _need_deepspeed()
    result, state = run_engine(tmp_path / engine, "--engine", engine, "--trainer", kind, *STEP, nproc=2)
    assert result["wrapped_class"] == "DeepSpeedEngine"
    assert _check_engaged_and_equal(result, state, reference[kind], 1e-5) < 1e-6


def test_deepspeed_zero3_bf16_is_as_close_as_stock_bf16(tmp_path, reference):
    """ZeRO-3 with the Trainer's bf16=True (DeepSpeed's bf16 engine): patched and stock both train; the patched run
    builds no logits, hands the Trainer an fp32 loss, and its weights are no farther from the fp32 process than
    stock bf16's (HF's smoothing on bf16 logits)."""
    _need_deepspeed()
    args = ("--engine", "zero3", "--precision", "bf16", *STEP)
    patched, p_state = run_engine(tmp_path / "patched", *args, nproc=2)
    stock, s_state = run_engine(tmp_path / "stock", *args, "--patch", 0, nproc=2)
    assert stock["full_logit_calls"] > 0 and stock["fused_calls"] == 0
    diff = _check_engaged_and_equal(patched, p_state, reference["trainer"], 2e-3)
    stock_diff = _rel(s_state, reference["trainer"][1])
    assert 0 < diff <= 1.25 * stock_diff, (diff, stock_diff)


def test_deepspeed_proof_fires_when_the_fused_op_is_bypassed(tmp_path):
    """A forward installed over the patch that never reaches it (what a second fused-loss library would do), under
    ZeRO-3: the step stops with the reason instead of training through full logits."""
    _need_deepspeed()
    result, _ = run_engine(tmp_path / "bypass", "--engine", "zero3", "--bypass", "--per-device", 2, nproc=1)
    assert result["error"] and result["error"].startswith("LsceNotEngagedError"), result["error"]
    assert "did not run through the fused op" in result["error"]


