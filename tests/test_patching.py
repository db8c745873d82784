"""apply_lsce_patch against the unpatched model, HF's own loss and HF's LabelSmoother (CPU, fp32)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.trainer_pt_utils import LabelSmoother

from hf_lsce import apply_lsce_patch, is_patched, revert_lsce_patch
from hf_lsce.ops import reference

from tiny_models import COMMON, FAMILIES, V, largest_tensor_mode, tiny_model


def tiny(model_type, seed=0, **over):
    """A tiny model of the family with its quirk settings (tiny_models.FAMILIES), head sharpened x 8: tiny random
    heads give a near-uniform softmax, where smoothing would change little."""
    return tiny_model(model_type, seed=seed, **over)


def batch(bsz=3, t=11, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (bsz, t), generator=g)
    labels = ids.clone()
    if ignore:
        labels[:, :3] = -100  # prompt tokens
        labels[0, -2:] = -100
    return ids, labels


@pytest.fixture(autouse=True)
def _clean():
    yield
    revert_lsce_patch()


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def unpatched_loss(model, ids, labels, b, **kw):
    """Stock smoothing of the unpatched model's logits (HF's LabelSmoother), plus, for a mixture of experts with its
    router's logits on, the auxiliary term the model's own forward adds to its loss when given labels."""
    out = model(input_ids=ids, **kw)
    if b == 0:
        loss = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].reshape(-1, V).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
    else:
        loss = LabelSmoother(epsilon=b)(out, labels, shift_labels=True)
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.router_aux_loss_coef * out.aux_loss
    return loss


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("b", [0.0, 0.1])
def test_patched_equals_unpatched_labelsmoother(family, b):
    """Every family of the table, its quirk exercised (soft-cap, logit scale, router loss): the patched loss and
    every gradient equal stock smoothing of the unpatched model's fp32 logits (+ the router's term)."""
    ref_model = tiny(family)
    model = copy.deepcopy(ref_model)
    apply_lsce_patch(model, label_smoothing=b)
    ids, labels = batch()
    ref_model.train(), model.train()
    ref = unpatched_loss(ref_model, ids, labels, b)
    ref.backward()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    assert rel(out.loss.detach(), ref.detach()) < 1e-5
    rg, g = grads(ref_model), grads(model)
    assert rg.keys() == g.keys()
    for name in rg:
        assert rel(g[name], rg[name]) < 1e-4, name
    if b == 0:  # and HF's own loss
        hf = ref_model(input_ids=ids, labels=labels).loss
        assert rel(out.loss.detach(), hf.detach()) < 1e-5
    if FAMILIES[family].get("output_router_logits"):  # the router's term is there, and large enough to be missed
        assert out.aux_loss is not None and torch.equal(out.aux_loss, ref_model(input_ids=ids).aux_loss)
        assert float(model.router_aux_loss_coef * out.aux_loss.detach()) > 1e-3 * float(ref.detach())


def test_packed_padding_free_batch_and_shift_labels():
    """One packed row with position_ids restarting per document (padding-free), and pre-shifted labels."""
    ref_model = tiny("llama")
    model = copy.deepcopy(ref_model)
    apply_lsce_patch(model, label_smoothing=0.1)
    ids, labels = batch(bsz=1, t=20)
    pos = torch.tensor([list(range(8)) + list(range(12))])
    labels[0, 8] = -100  # first token of the second document predicts nothing across the boundary
    ref = unpatched_loss(ref_model, ids, labels, 0.1, position_ids=pos)
    got = model(input_ids=ids, labels=labels, position_ids=pos).loss
    assert rel(got.detach(), ref.detach()) < 1e-5
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    got2 = model(input_ids=ids, shift_labels=shifted, position_ids=pos).loss
    assert rel(got2.detach(), ref.detach()) < 1e-5


def test_num_items_in_batch_and_return_dict_false():
    model = apply_lsce_patch(tiny("qwen3"), label_smoothing=0.1)
    ids, labels = batch()
    n = (labels[:, 1:] != -100).sum()
    a = model(input_ids=ids, labels=labels).loss
    b = model(input_ids=ids, labels=labels, num_items_in_batch=2 * n).loss
    assert torch.allclose(a / 2, b)
    tup = model(input_ids=ids, labels=labels, return_dict=False)
    assert isinstance(tup, tuple) and torch.allclose(tup[0], a)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("extra", [{}, {"use_cache": False, "output_hidden_states": True}])
def test_return_dict_false_keeps_the_stock_positions(model_type, extra):
    """Training with return_dict=False: the tuple has the stock model's positions, the logits' place holding None
    (none are made), so the cache or hidden states do not move into it (transformers' to_tuple drops None fields).
    Mutation check: to_tuple there fails."""
    stock = tiny(model_type).train()
    model = apply_lsce_patch(tiny(model_type), label_smoothing=0.1).train()
    ids, labels = batch()
    got = model(input_ids=ids, labels=labels, return_dict=False, **extra)
    want = stock(input_ids=ids, labels=labels, return_dict=False, **extra)
    logits_at = next(i for i, x in enumerate(want) if torch.is_tensor(x) and x.dim() == 3 and x.shape[-1] == V)
    assert len(got) == len(want) and got[logits_at] is None
    assert [type(x) for i, x in enumerate(got) if i != logits_at] == [type(x) for i, x in enumerate(want)
                                                                    if i != logits_at]


def test_no_logits_built_in_patched_training(monkeypatch):
    """The lm_head module is never called and no tensor of N x V elements exists."""
    big_v = 1009  # large enough that N x V dwarfs every backbone activation
    monkeypatch.setattr(reference, "_CHUNK_ELEMENTS", 8 * big_v)  # fallback: 8 rows at a time
    model = apply_lsce_patch(tiny("llama", vocab_size=big_v), label_smoothing=0.1)
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    ids, labels = batch(bsz=8, t=32)  # N / 4 > hidden size: N x V / 4 exceeds the V x D weight and its grad
    n_tokens = ids.numel()
    with largest_tensor_mode() as mode:
        model(input_ids=ids, labels=labels).loss.backward()
    assert not calls
    assert mode.numel < n_tokens * big_v // 4, (mode.numel, n_tokens * big_v)
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_generation_and_eval_logits_unchanged_bit_for_bit(family):
    ref_model = tiny(family).eval()
    model = apply_lsce_patch(copy.deepcopy(ref_model)).eval()
    ids, labels = batch()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref_model(input_ids=ids).logits)
        out, ref = model(input_ids=ids, labels=labels), ref_model(input_ids=ids, labels=labels)
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)
        assert torch.equal(model(input_ids=ids, logits_to_keep=1).logits, ref_model(input_ids=ids, logits_to_keep=1).logits)
        g1 = model.generate(ids[:1], max_new_tokens=5, do_sample=False)
        g2 = ref_model.generate(ids[:1], max_new_tokens=5, do_sample=False)
    assert torch.equal(g1, g2)


def test_eval_loss_smoothed_from_logits_and_fused_eval_option():
    ref_model = tiny("mistral").eval()
    ids, labels = batch()
    with torch.no_grad():
        ref = unpatched_loss(ref_model, ids, labels, 0.1)
        m = apply_lsce_patch(copy.deepcopy(ref_model), label_smoothing=0.1).eval()
        out = m(input_ids=ids, labels=labels)
        assert out.logits is not None and rel(out.loss, ref) < 1e-5
        m2 = apply_lsce_patch(copy.deepcopy(ref_model), label_smoothing=0.1, fused_eval_loss=True).eval()
        out2 = m2(input_ids=ids, labels=labels)
        assert out2.logits is None and rel(out2.loss, ref) < 1e-5


def test_revert_and_class_patch_and_twice(tmp_path):
    from transformers import LlamaForCausalLM

    orig = LlamaForCausalLM.forward
    apply_lsce_patch()
    apply_lsce_patch()  # harmless
    assert LlamaForCausalLM.forward is not orig
    model = tiny("llama")
    assert is_patched(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert is_patched(loaded)
    for (n, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), n
    revert_lsce_patch()
    assert LlamaForCausalLM.forward is orig and not is_patched(model)
    inst = apply_lsce_patch(tiny("llama"))
    apply_lsce_patch(inst)
    assert is_patched(inst)
    revert_lsce_patch(inst)
    assert not is_patched(inst) and "forward" not in inst.__dict__


def test_unsupported_models_fail_closed():
    with pytest.raises(ValueError, match="pretraining_tp"):
        apply_lsce_patch(tiny("llama", pretraining_tp=2))
    with pytest.raises(ValueError, match=r"patch the loaded model instead \(apply_lsce_patch\(model\)\)"):
        apply_lsce_patch(model_type="gpt2")  # a class patch needs the table; an instance is verified
    with pytest.raises(ValueError, match="config.output_multiplier=2.0 scales the logits"):
        apply_lsce_patch(tiny("llama", output_multiplier=2.0))  # a scaling attribute the family's entry does not name
    with pytest.raises(ValueError, match="label_smoothing"):
        apply_lsce_patch(tiny("llama"), label_smoothing=2.0)
    m = tiny("llama")
    m.lm_head = torch.nn.Sequential(m.lm_head)  # e.g. a wrapped head
    m.config.tie_word_embeddings = False
    with pytest.raises(ValueError, match="nn.Linear"):
        apply_lsce_patch(m)
    # class patch, then a config the op cannot reproduce: fails at the forward, not silently
    apply_lsce_patch(model_type="llama")
    bad = tiny("llama")
    bad.config.pretraining_tp = 4
    bad.train()  # the fused (training) path is the one that must refuse it
    ids, labels = batch()
    with pytest.raises(ValueError, match="pretraining_tp"):
        bad(input_ids=ids, labels=labels)


# ----------------------------------------------------------------- families outside the table
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=64, resid_pdrop=0.0,
                                       embd_pdrop=0.0, attn_pdrop=0.0)).float()  # no dropout: comparable runs
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # tied to the input embedding: both sharpened
    return model


def _without_table_entry(monkeypatch, family):
    from hf_lsce.patching import models

    monkeypatch.setattr(models, "MODEL_TABLE", {k: v for k, v in models.MODEL_TABLE.items() if k != family})


@pytest.mark.parametrize("case", ["gpt2", "phi3", "starcoder2"])
def test_family_outside_the_table_is_verified_on_the_model_then_exact(case, monkeypatch):
    """GPT-2 (backbone .transformer, a tied head) is in no table; phi3 and starcoder2 with their entries removed stand
    for any family a newer transformers adds. apply_lsce_patch(model) runs the check, then the loss and every
    gradient equal stock smoothing, and the check left the model as it found it."""
    if case == "gpt2":
        ref_model = _gpt2()
    else:
        ref_model = tiny(case)
        _without_table_entry(monkeypatch, case)
    model = copy.deepcopy(ref_model).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lsce_patch(model, label_smoothing=0.1)
    assert model._lsce_generic_spec.generic and model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks for m in model.modules()) and all(p.grad is None for p in model.parameters())
    ids, labels = batch()
    ref_model.train()
    ref = unpatched_loss(ref_model, ids, labels, 0.1)
    ref.backward()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None and rel(out.loss.detach(), ref.detach()) < 1e-5
    rg, g = grads(ref_model), grads(model)
    assert rg.keys() == g.keys() and all(rel(g[n], rg[n]) < 1e-4 for n in rg)
    revert_lsce_patch(model)
    assert "_lsce_generic_spec" not in model.__dict__


def _odd_llama(transform):
    """A causal LM outside the table whose forward does something to its logits or loss that the table does not
    know, by a factor so close to 1 that only an exact check sees it."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class OddConfig(LlamaConfig):
        model_type = "odd_llama"

    class OddForCausalLM(LlamaForCausalLM):
        config_class = OddConfig

        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            if transform == "before_head":
                hidden = hidden * 1.0001
            logits = self.lm_head(hidden)
            if transform == "scale":
                logits = logits * 1.0001
            elif transform == "softcap":  # a cap far above these logits: changes them by ~1e-7 relative
                logits = 1000.0 * torch.tanh(logits / 1000.0)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
                if transform == "z_loss":
                    loss = loss + 1e-4 * torch.logsumexp(logits.float(), -1).pow(2).mean()
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    torch.manual_seed(0)
    return OddForCausalLM(OddConfig(**tiny("llama").config.to_diff_dict()))


@pytest.mark.parametrize("transform,why", [
    ("scale", "not the lm_head's output"), ("softcap", "not the lm_head's output"),
    ("before_head", "input is not the backbone's last hidden state"),
    ("z_loss", "not the shifted cross-entropy of its logits"), ("none", None)])
def test_unknown_logit_transform_fails_the_check(transform, why):
    """Each transform the table does not know is refused with the reason, however small; the same class without
    one passes (so the refusals are the transforms', not the subclass's)."""
    model = _odd_llama(transform)
    if why is None:
        assert apply_lsce_patch(model)._lsce_generic_spec.classes == ("OddForCausalLM",)
        return
    with pytest.raises(ValueError, match=why):
        apply_lsce_patch(model)
    assert not is_patched(model)


def test_moe_outside_the_table_with_its_router_loss_is_refused(monkeypatch):
    _without_table_entry(monkeypatch, "mixtral")
    with pytest.raises(ValueError, match="auxiliary"):
        apply_lsce_patch(tiny("mixtral"))
    apply_lsce_patch(tiny("mixtral", output_router_logits=False))  # its loss is then the plain cross-entropy


# ----------------------------------------------------------------- Trainer
class _Data(torch.utils.data.Dataset):
    """Rows of different lengths (right-padded with -100) so micro-batches hold different token counts."""

    def __init__(self, n=8, t=12):
        g = torch.Generator().manual_seed(1)
        self.rows = []
        for i in range(n):
            ids = torch.randint(0, V, (t,), generator=g)
            lab = ids.clone()
            lab[2 + i:] = -100
            self.rows.append({"input_ids": ids, "labels": lab})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _train_one_step(model, tmp_path, bs, ga, b):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=bs, gradient_accumulation_steps=ga,
                             max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                             label_smoothing_factor=b, report_to=[], save_strategy="no", logging_steps=1,
                             use_cpu=True, seed=0, dataloader_drop_last=False, max_grad_norm=0.0)
    trainer = Trainer(model=model, args=args, train_dataset=_Data())
    trainer.train()
    return trainer


def test_trainer_label_smoothing_factor_with_gradient_accumulation(tmp_path):
    base = tiny("llama")
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    m1 = apply_lsce_patch(copy.deepcopy(base))
    m2 = apply_lsce_patch(copy.deepcopy(base))
    calls = []
    m1.lm_head.register_forward_hook(lambda *a: calls.append(1))
    t1 = _train_one_step(m1, tmp_path / "a", bs=8, ga=1, b=0.1)
    _train_one_step(m2, tmp_path / "b", bs=2, ga=4, b=0.1)
    assert not calls and t1.label_smoother is None
    assert m1._lsce_label_smoothing == 0.1
    # SGD with lr 1: the update is the gradient. 4 x 2 accumulated equals 1 x 8.
    for n, p in m1.named_parameters():
        d1, d2 = before[n] - p.detach(), before[n] - dict(m2.named_parameters())[n].detach()
        if d1.norm() > 0:
            assert rel(d2, d1) < 1e-4, n
    # and the 1 x 8 gradient is HF's LabelSmoother's on the unpatched model
    ref = copy.deepcopy(base)
    rows = _Data().rows
    ids = torch.stack([r["input_ids"] for r in rows])
    lab = torch.stack([r["labels"] for r in rows])
    unpatched_loss(ref, ids, lab, 0.1).backward()
    for n, p in ref.named_parameters():
        if p.grad is not None and p.grad.norm() > 0:
            assert rel(before[n] - dict(m1.named_parameters())[n].detach(), p.grad) < 1e-4, n


def test_sft_trainer_smoothing_metrics_and_no_logits(tmp_path):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers
    from trl import SFTConfig, SFTTrainer

    words = [f"w{i}" for i in range(V - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt": " ".join(words[j] for j in torch.randint(0, 50, (5,), generator=g).tolist()),
             "completion": " " + " ".join(words[j] for j in torch.randint(0, 50, (4,), generator=g).tolist())}
            for _ in range(16)]
    ds = Dataset.from_list(rows)

    def make(model, b, out, **over):
        cfg = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                        label_smoothing_factor=b, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                        completion_only_loss=True, learning_rate=1e-3, **over)
        return SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tokenizer)

    import trl.trainer.sft_trainer as sft_module

    base = tiny("llama", pad_token_id=0, eos_token_id=1, bos_token_id=None)
    # TRL 1.9's default chunked loss cannot smooth (it crashes under the LabelSmoother): stock smoothing is its "nll"
    stock_over = dict(loss_type="nll") if hasattr(sft_module, "_patch_chunked_ce_lm_head") else {}
    ref_tr = make(copy.deepcopy(base), 0.1, tmp_path / "ref", **stock_over)
    batch_ = next(iter(ref_tr.get_train_dataloader()))
    ref_tr.model.train()
    ref_loss = ref_tr.compute_loss(ref_tr.model, dict(batch_))
    model = apply_lsce_patch(copy.deepcopy(base))
    tr = make(model, 0.1, tmp_path / "ours")
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    model.train()
    loss = tr.compute_loss(model, dict(batch_))
    assert not calls, "lm_head called in compute_loss"
    assert tr.label_smoother is None
    assert rel(loss.detach(), ref_loss.detach()) < 1e-5
    tr._metrics["train"].clear()
    tr.train()
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert logs and all(k in logs[0] for k in ("entropy", "mean_token_accuracy"))
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert not calls, "lm_head called in train"


@pytest.mark.parametrize("cap", [None, 2.0])
def test_gemma3_conditional_generation_text_path(cap):
    """Gemma3ForConditionalGeneration, text-only batch, vs LabelSmoother on the stock model's own logits, with and
    without ``final_logit_softcapping`` in its text config (transformers 5.x's forward ignores it, where
    Gemma3ForCausalLM's applies it: the patch follows the class's forward; a cap of 2 bends these logits enough that
    applying it would fail the gradient check by about 5e-3)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(COMMON, final_logit_softcapping=cap)
    text.pop("max_position_embeddings")
    cfg = Gemma3Config(text_config=text, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                            num_attention_heads=2, image_size=28, patch_size=14),
                       mm_tokens_per_image=4, image_token_index=V - 1, boi_token_index=V - 2, eoi_token_index=V - 3)
    torch.manual_seed(0)
    ref_model = Gemma3ForConditionalGeneration(cfg).float().train()
    model = apply_lsce_patch(copy.deepcopy(ref_model), label_smoothing=0.1)
    ids, labels = batch()
    ids = ids.clamp(max=V - 4)
    labels = torch.where(labels == -100, labels, ids)
    assert_equals_stock_smoothing(ref_model, model, ids, labels, 0.1)


def assert_equals_stock_smoothing(ref_model, model, ids, labels, b, what=""):
    """The patched model's loss (no logits returned) and every non-zero gradient equal the Trainer's LabelSmoother on
    the stock model's own logits."""
    ref = LabelSmoother(epsilon=b)(ref_model(input_ids=ids), labels, shift_labels=True)
    ref.backward()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None and rel(out.loss.detach(), ref.detach()) < 1e-5, what
    rg, g = grads(ref_model), grads(model)
    for name in rg:
        if rg[name].norm() > 0:
            assert rel(g[name], rg[name]) < 1e-4, (what, name)


def test_a_config_cap_the_class_does_not_apply_is_not_applied():
    """A stray final_logit_softcapping in a Llama config (LlamaForCausalLM's forward ignores it): the patched loss and
    gradients equal the stock model's, uncapped; Gemma2ForCausalLM's forward applies its cap, and so does the patch."""
    from hf_lsce.patching.models import softcap_of

    for family, cap_applied in (("llama", False), ("gemma2", True)):
        ref_model = tiny_model(family, final_logit_softcapping=2.0).train()
        model = apply_lsce_patch(copy.deepcopy(ref_model), label_smoothing=0.1)
        assert softcap_of(model) == (2.0 if cap_applied else None)
        assert_equals_stock_smoothing(ref_model, model, *batch(), 0.1, family)
    # the class patch (hf-lsce run) reads the class's own forward through the patch
    import hf_lsce.patching.models as models

    for family, cap in (("llama", None), ("gemma2", 2.0)):
        apply_lsce_patch(model_type=family, label_smoothing=0.1)
        models._applies_softcap.cache_clear()  # read afresh, from the patched class
        try:
            assert softcap_of(tiny_model(family, final_logit_softcapping=2.0)) == cap, family
        finally:
            revert_lsce_patch(model_type=family)
            models._applies_softcap.cache_clear()


def test_config_softcap_follows_the_configs_architecture():
    """What hf-lsce diagnose reads from a config alone (no model): the cap where the named class applies it."""
    from transformers import Gemma2Config, LlamaConfig

    from hf_lsce.patching.models import config_softcap

    assert config_softcap(LlamaConfig(final_logit_softcapping=2.0, architectures=["LlamaForCausalLM"])) is None
    assert config_softcap(Gemma2Config(final_logit_softcapping=30.0, architectures=["Gemma2ForCausalLM"])) == 30.0
    assert config_softcap(Gemma2Config(final_logit_softcapping=30.0)) == 30.0  # no class named: the config's value


def test_a_config_cap_whose_application_cannot_be_read_is_refused(monkeypatch):
    """Gemma2ForCausalLM's forward hidden by a decorator that does not say what it wraps (no __wrapped__): the source
    read is not the forward's, so whether it applies the cap is unknown, and the patch refuses rather than guess."""
    from transformers import Gemma2ForCausalLM

    import hf_lsce.patching.models as models

    model = tiny_model("gemma2", final_logit_softcapping=2.0)
    real = Gemma2ForCausalLM.forward

    def forward(self, *args, **kwargs):  # an opaque wrapper
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Gemma2ForCausalLM, "forward", forward)
    models._applies_softcap.cache_clear()
    try:
        assert models._applies_softcap(Gemma2ForCausalLM) is None
        with pytest.raises(ValueError, match="final_logit_softcapping=2.0.*cannot be read"):
            apply_lsce_patch(model)
    finally:
        models._applies_softcap.cache_clear()


@pytest.mark.parametrize("shifted", [False, True])
def test_fused_lm_head_protocol_equals_trl_own_fused_head(shifted):
    """model(..., fused_lm_head=True) through the patch against TRL's add_fused_lm_head on an unpatched copy, at
    b = 0: per-token log-probabilities, entropy, top-1 hits and the mask, element by element. Half the labels are
    set to the model's own argmax so that a misaligned accuracy cannot pass."""
    add_fused_lm_head = getattr(pytest.importorskip("trl.trainer.utils"), "add_fused_lm_head", None)
    if add_fused_lm_head is None:
        pytest.skip("this TRL has no fused LM head (TRL < 1.10): nothing to compare the protocol with")

    ref_model = tiny("llama").train()
    model = apply_lsce_patch(copy.deepcopy(ref_model), label_smoothing=0.0)
    add_fused_lm_head(ref_model, outputs=("log_probs", "entropy", "is_top1"))
    ids, labels = batch()
    with torch.no_grad():
        pred = ref_model(input_ids=ids).logits.argmax(-1)  # position t predicts token t + 1
    labels[:, 1::2] = torch.where(labels[:, 1::2] == -100, labels[:, 1::2], pred[:, :-1][:, ::2][:, : labels[:, 1::2].shape[1]])
    kw = dict(shift_labels=torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]) if shifted else dict(labels=labels)
    ours = model(input_ids=ids, fused_lm_head=True, **kw)
    ref = ref_model(input_ids=ids, fused_lm_head=True, **kw)
    assert ours.log_probs.shape == ref.log_probs.shape
    assert torch.equal(ours.label_mask.bool(), ref.label_mask.bool())
    mask = ours.label_mask.bool()
    assert torch.allclose(ours.log_probs[mask], ref.log_probs[mask], atol=1e-5)
    assert torch.allclose(ours.entropy[mask], ref.entropy[mask], atol=1e-4)
    assert torch.equal(ours.is_top1.bool(), ref.is_top1.bool())
    assert int(ours.is_top1.sum()) >= 4  # the argmax labels are hits
    assert torch.allclose(ours.loss, ref.loss, atol=1e-6)


def test_cuda_graph_replays_are_trusted_only_after_a_counted_step(monkeypatch):
    """Under the Trainer's torch_compile_mode='reduce-overhead' a replayed step runs no Python, so the op reports no
    call: accepted once an earlier (recorded) step was counted through the op, refused otherwise and in other modes."""
    from types import SimpleNamespace

    from hf_lsce.patching import ENGAGEMENT
    from hf_lsce.patching.trainer import LsceNotEngagedError, _verify_engaged

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = tiny("llama")

    def trainer(mode, confirmed):
        return SimpleNamespace(args=SimpleNamespace(torch_compile=True, torch_compile_mode=mode),
                               compute_loss_func=None, _lsce_confirmed=confirmed)

    before = ENGAGEMENT.start()  # no fused call follows
    _verify_engaged(trainer("reduce-overhead", True), model, 0.1, "label_smoothing_factor", before)
    for mode, confirmed in (("reduce-overhead", False), (None, True), ("default", True)):
        with pytest.raises(LsceNotEngagedError, match="did not run through the fused op"):
            _verify_engaged(trainer(mode, confirmed), model, 0.1, "label_smoothing_factor", before)


@pytest.mark.parametrize("b", [0.1, 0.0])
def test_chunked_token_stats_in_evaluation_from_the_logits(b):
    """TRL 1.x's chunked loss protocol (TRL 1.14 for one calls compute_loss in evaluation and reads
    ``num_valid_tokens``, ``entropy_sum`` and ``num_correct_tokens``, which its own chunked forward, replaced by the
    patch, returns there too): in evaluation the patched forward builds the logits and returns the three sums, equal
    to those of the stock model's logits, and the loss equals stock smoothing's."""
    ref_model = tiny("llama").eval()
    model = apply_lsce_patch(copy.deepcopy(ref_model), label_smoothing=b).eval()
    ids, labels = batch()
    model.__dict__["_lsce_token_stats"] = "chunked"
    try:
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels)
            logits = ref_model(input_ids=ids).logits.double()
    finally:
        model.__dict__.pop("_lsce_token_stats")
    nxt = F.pad(labels, (0, 1), value=-100)[:, 1:]
    valid = nxt != -100
    p = logits.softmax(-1)
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert int(out.num_valid_tokens) == int(valid.sum())
    assert rel(out.entropy_sum.double(), (entropy * valid).sum()) < 1e-5
    assert int(out.num_correct_tokens) == int(((logits.argmax(-1) == nxt) & valid).sum())
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), nxt.reshape(-1), label_smoothing=b)
    assert rel(out.loss.double(), ref) < 1e-5
