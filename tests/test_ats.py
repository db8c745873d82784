"""ATSCalibrator: the selective smoothing loss against an independent fp64 computation (both paths),
gradients, ranking, save/load, bad input, and a calibration gain on an overconfident small model."""
import json
import math
import os

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hf_lsce.ats import ATSCalibrator, ATSConfig, fused_selective_smoothing_loss, selective_smoothing_loss
from hf_lsce.calibration import calibration_metrics

V, L = 64, 24


def _reference_loss(logits, labels, alpha):
    """The spec, written out in fp64 with explicit sets (labels already shifted)."""
    logits, labels = logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    hard, smooth = [], []
    for z, y in zip(logits, labels):
        if y == -100:
            continue
        logp = torch.log_softmax(z, -1)
        if alpha is None or int(z.argmax()) == int(y):
            hard.append(-logp[y])
        else:
            smooth.append(-logp.mean())
    if alpha is None:
        return torch.stack(hard + smooth).mean()
    if not hard:
        return torch.stack(smooth).mean()
    if not smooth:
        return torch.stack(hard).mean()
    n = len(hard) + len(smooth)
    w_h, w_s = (1 - alpha) * len(smooth) / n, alpha * len(hard) / n
    return (w_h * torch.stack(hard).mean() + w_s * torch.stack(smooth).mean()) / (w_h + w_s)


def _shifted(labels):
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


@pytest.mark.parametrize("alpha", [0.5, 0.3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loss_paths_match_independent_reference(alpha, dtype):
    g = torch.Generator().manual_seed(1)
    b, t, d, v = 3, 11, 16, 37
    w = torch.randn(v, d, generator=g, dtype=dtype)
    h = torch.randn(b, t, d, generator=g, dtype=dtype)
    s = torch.rand(b, t, generator=g, dtype=dtype) * 3 + 0.05
    labels = torch.randint(0, v, (b, t), generator=g)
    base_pred = (h @ w.T).argmax(-1)
    labels[:, 1::2] = base_pred[:, 0:-1:2]  # position t predicts labels[t + 1]: many correct tokens
    labels[0, :4] = -100
    want = _reference_loss((h @ w.T).double() * s[..., None].double(), _shifted(labels), alpha)
    got_mat = selective_smoothing_loss((h @ w.T) * s[..., None], labels, alpha=alpha)
    got_fused = fused_selective_smoothing_loss(h, s, w, labels, alpha=alpha)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    assert float(got_mat) == pytest.approx(float(want), rel=tol)
    assert float(got_fused) == pytest.approx(float(want), rel=tol)
    # gradients w.r.t. the scale agree between the two paths
    s1, s2 = s.clone().requires_grad_(), s.clone().requires_grad_()
    selective_smoothing_loss((h @ w.T) * s1[..., None], labels, alpha=alpha).backward()
    fused_selective_smoothing_loss(h, s2, w, labels, alpha=alpha).backward()
    assert torch.allclose(s1.grad, s2.grad, rtol=1e-4, atol=1e-6 if dtype == torch.float32 else 1e-12)


def test_loss_edge_cases():
    z = torch.tensor([[[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 1.0]]])
    all_right = torch.tensor([[0, 1, 2]])  # shifted: position 0 predicts 1 (right), 1 predicts 2 (wrong)
    loss = selective_smoothing_loss(z, all_right)
    assert float(loss) == pytest.approx(float(_reference_loss(z, _shifted(all_right), 0.5)))
    assert float(selective_smoothing_loss(z, torch.full((1, 3), -100))) == 0.0
    only_right = torch.tensor([[0, 0, 1]])  # both shifted labels equal the argmax
    want = -torch.log_softmax(z[0, :2], -1)[[0, 1], [0, 1]].mean()
    assert float(selective_smoothing_loss(z, only_right)) == pytest.approx(float(want))


def _tiny_config(**kw):
    kw = {"vocab_size": V, **kw}
    return AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, **kw)


def _make_sequences(n, g):
    """Even positions: random tokens (unpredictable); odd positions: a fixed function of the previous
    token (predictable). A model that memorises a small training set is overconfident on the former."""
    x = torch.randint(8, 40, (n, L), generator=g)
    x[:, 1::2] = (x[:, 0::2] * 7 + 3) % 24 + 40
    return x


@pytest.fixture(scope="module")
def overconfident_lm():
    g = torch.Generator().manual_seed(0)
    train, calib, test = _make_sequences(64, g), _make_sequences(128, g), _make_sequences(256, g)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_tiny_config())
    opt = torch.optim.AdamW(base.parameters(), lr=3e-3)
    for _ in range(300):
        idx = torch.randint(0, 64, (16,))
        loss = base(train[idx], labels=train[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    return base.eval(), calib, test


def _token_calibration(model, data):
    with torch.no_grad():
        logits = model(data).logits[:, :-1].float()
    conf, pred = torch.softmax(logits, -1).max(-1)
    return calibration_metrics(confidences=conf.reshape(-1), correct=(pred == data[:, 1:]).reshape(-1).double())


def _fit(base, data, head_type, loss_type, lr, steps=150):
    torch.manual_seed(0)
    cal = ATSCalibrator.from_base(base, head_type=head_type, loss_type=loss_type).train()
    opt = torch.optim.AdamW(cal.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, data.shape[0], (16,), generator=g)
        loss = cal(data[idx], labels=data[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return cal.eval()


def test_ats_lowers_heldout_ece_and_beats_temperature_scaling(overconfident_lm):
    base, calib, test = overconfident_lm
    r_base = _token_calibration(base, test)
    assert r_base.mean_confidence - r_base.accuracy > 0.2  # the base is overconfident
    ts = _token_calibration(_fit(base, calib, "scalar", "nll", 5e-2), test)
    ats_mlp = _token_calibration(_fit(base, calib, "mlp", "selective", 1e-2), test)
    ats_tf = _token_calibration(_fit(base, calib, "transformer", "selective", 2e-3), test)
    for r in (ts, ats_mlp, ats_tf):
        assert r.accuracy == r_base.accuracy  # calibration never changes a prediction
    assert ts.ece < r_base.ece
    assert ats_mlp.ece < 0.5 * r_base.ece and ats_mlp.ece <= ts.ece
    assert ats_tf.ece < 0.5 * r_base.ece and ats_tf.ece <= ts.ece


def test_only_head_gets_gradients_ranking_kept_and_paths_agree(overconfident_lm):
    base, calib, _ = overconfident_lm
    cal = ATSCalibrator.from_base(base, head_type="transformer")
    with torch.no_grad():
        cal.head.out.weight.normal_(0, 0.5)
    labels = calib[:4].clone()
    labels[:, :5] = -100
    cal.train()
    fused = cal(calib[:4], labels=labels)
    assert fused.logits is None  # the fused path builds no logits
    fused.loss.backward()
    g_fused = [p.grad.clone() for p in cal.parameters()]
    assert all(g.abs().sum() > 0 for g in g_fused)
    assert all(p.grad is None and not p.requires_grad for p in base.parameters())
    cal.zero_grad()
    cal.loss_path = "materialise"
    mat = cal(calib[:4], labels=labels)
    mat.loss.backward()
    assert float(mat.loss.detach()) == pytest.approx(float(fused.loss.detach()), rel=1e-5)
    for a, p in zip(g_fused, cal.parameters()):
        assert torch.allclose(a, p.grad, rtol=1e-3, atol=1e-6)
    cal.eval()
    with torch.no_grad():
        z_base = base(calib[:4]).logits
        z_cal = cal(calib[:4]).logits
    assert torch.equal(z_base.argmax(-1), z_cal.argmax(-1))
    assert torch.equal(z_base.topk(5, -1).indices, z_cal.topk(5, -1).indices)
    s = cal.inverse_temperature(cal._base_hidden(calib[:4], None, None)[0])
    assert (s > 0).all() and (s <= 10).all() and not torch.allclose(s, torch.ones_like(s))


def test_save_load_round_trip_head_only(overconfident_lm, tmp_path):
    base, calib, _ = overconfident_lm
    cal = ATSCalibrator.from_base(base, head_type="mlp")
    with torch.no_grad():
        cal.head.out.weight.normal_()
    cal.save_pretrained(tmp_path / "head")
    from safetensors.torch import load_file

    keys = load_file(str(tmp_path / "head" / "model.safetensors")).keys()
    assert keys and all(k.startswith("head.") for k in keys)  # the base is not saved
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["model_type"] == "ats_calibrator" and cfg["base_vocab_size"] == V
    again = ATSCalibrator.from_pretrained(tmp_path / "head", base_model=base)
    auto = AutoModel.from_pretrained(tmp_path / "head", base_model=base)
    assert type(auto) is ATSCalibrator
    with torch.no_grad():
        want = cal.eval()(calib[:2]).logits
        assert torch.equal(again(calib[:2]).logits, want) and torch.equal(auto(calib[:2]).logits, want)
    # the base by path, from the config
    base.save_pretrained(tmp_path / "base")
    cal2 = ATSCalibrator.from_base(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), head_type="linear")
    cal2.save_pretrained(tmp_path / "head2")
    assert ATSCalibrator.from_pretrained(tmp_path / "head2").config.base_model_name_or_path == str(tmp_path / "base")


def test_bad_input_errors(overconfident_lm, tmp_path):
    base, _, _ = overconfident_lm
    cal = ATSCalibrator.from_base(base, head_type="linear")
    cal.save_pretrained(tmp_path / "head")
    other = AutoModelForCausalLM.from_config(_tiny_config(vocab_size=V + 5))
    with pytest.raises(ValueError, match="different base model: base_vocab_size is 69, the head expects 64"):
        ATSCalibrator.from_pretrained(tmp_path / "head", base_model=other)
    with pytest.raises(ValueError, match="not a causal LM with an lm_head"):
        ATSCalibrator.from_base(AutoModel.from_config(_tiny_config()))
    with pytest.raises(ValueError, match="head_type"):
        ATSConfig(head_type="conv")
    with pytest.raises(ValueError, match="names its base|base_model="):
        ATSCalibrator.from_pretrained(tmp_path / "head")
    from hf_lsce.ats.training import check_tokenizer
    from hf_lsce.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["some text to learn from " * 50], vocab_size=400)
    with pytest.raises(ValueError, match="do not belong together"):
        check_tokenizer(base, tok)


def test_logits_processor_scales_sampling_not_greedy(overconfident_lm):
    base, calib, _ = overconfident_lm
    cal = ATSCalibrator.from_base(base, head_type="mlp")
    with torch.no_grad():
        cal.head.out.bias.fill_(-1.0)  # s = e^-1 everywhere
    prompt = calib[:2, :6]
    greedy = base.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with_ats = base.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0,
                             logits_processor=[cal.logits_processor()])
    assert torch.equal(greedy, with_ats)
    scores = torch.randn(2, V)
    out = cal.logits_processor()(prompt, scores.clone())
    assert torch.allclose(out, scores * math.exp(-1.0), rtol=1e-5)


def _random_head(base, head_type):
    cal = ATSCalibrator.from_base(base, head_type=head_type)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in cal.head.parameters():  # far from the identity the untrained head starts at
            p.normal_(0.0, 0.3)
    return cal


@pytest.mark.parametrize("head_type", ["transformer", "mlp"])
def test_generate_keeps_the_cache_and_equals_the_recomputing_processor(overconfident_lm, head_type):
    """ATSCalibrator.generate reads the hidden states of the base's own cached forward: one backbone call per step
    (the recomputing processor makes two), with the same calibrated scores and tokens."""
    from hf_lsce.ats.modeling_ats import _backbone

    base, calib, _ = overconfident_lm
    cal = _random_head(base, head_type)
    prompt = calib[:2, :6]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    calls, head_rows = [], []
    hook = _backbone(base).register_forward_hook(lambda *a: calls.append(1))
    if head_type == "transformer":  # the positions the head's layer runs on at each step
        head_hook = cal.head.layer.register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[1]))
    try:
        cached = cal.generate(prompt, **kw)
        n_cached, rows_cached = len(calls), list(head_rows)
        proc = cal.logits_processor()
        ref = base.generate(prompt, logits_processor=[proc], **kw)
        n_ref = len(calls) - n_cached
    finally:
        hook.remove()
        if head_type == "transformer":
            head_hook.remove()
    plain = base.generate(prompt, **kw)
    assert (n_cached, n_ref, proc.recomputed) == (6, 12, 6)
    if head_type == "transformer":  # its own KV cache: the prompt, then one position a step
        assert rows_cached == [6, 1, 1, 1, 1, 1] and head_rows[6:] == [6, 7, 8, 9, 10, 11]
    assert torch.equal(cached.sequences, ref.sequences) and torch.equal(cached.sequences, plain.sequences)
    for a, b, c in zip(cached.scores, ref.scores, plain.scores):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(a, c, rtol=1e-2)  # the scores were scaled


def _left_padded_pair(calib):
    """Two prompts of 6 and 4 tokens, the second left-padded to the first's length: (a, b, the batch, its mask)."""
    a, b = calib[0, :6], calib[1, :4]
    batch = torch.stack([a, torch.cat([torch.zeros(2, dtype=b.dtype), b])])
    return a, b, batch, torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])


def test_generate_left_padded_rows_equal_their_own_unpadded_runs(overconfident_lm):
    """A left-padded batch: each row's calibrated scores equal those of the row generated alone, through the cached
    path and through the recomputing processor given the prompt's attention mask."""
    base, calib, _ = overconfident_lm
    cal = _random_head(base, "transformer")
    a, b, batch, mask = _left_padded_pair(calib)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    out = cal.generate(batch, attention_mask=mask, **kw)
    rec = base.generate(batch, attention_mask=mask, logits_processor=[cal.logits_processor(mask)], **kw)
    for row, alone in ((0, cal.generate(a[None], **kw)), (1, cal.generate(b[None], **kw))):
        for got, again, want in zip(out.scores, rec.scores, alone.scores):
            assert torch.allclose(got[row], want[0], rtol=1e-4, atol=1e-4)
            assert torch.allclose(again[row], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("expand", ["num_return_sequences", "num_beams"])
def test_generate_left_padded_prompts_repeated_by_generate(overconfident_lm, expand):
    """generate repeats each prompt for its beams or num_return_sequences: the prompt's mask is repeated with it, so
    a padded prompt's rows equal the prompt generated alone, through the cached path and the recomputing processor
    (every step under beam search; the first step when sampling, whose later tokens differ). Mutation check: the mask
    dropped where its rows differ from the ids' fails (errors of 1e-2 to 4e-2 in the scores)."""
    base, calib, _ = overconfident_lm
    cal = _random_head(base, "transformer")
    a, b, batch, mask = _left_padded_pair(calib)
    kw = dict(max_new_tokens=3, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    kw.update(dict(do_sample=True, top_k=0, num_return_sequences=2) if expand == "num_return_sequences" else
              dict(num_beams=2, do_sample=False))
    runs = []
    for make in (lambda: cal.generate(batch, attention_mask=mask, **kw),
                 lambda: base.generate(batch, attention_mask=mask, logits_processor=[cal.logits_processor(mask)], **kw),
                 lambda: cal.generate(b[None], **kw)):
        torch.manual_seed(0)
        runs.append(make())
    cached, recomputed, alone = runs
    steps = 1 if expand == "num_return_sequences" else len(alone.scores)
    for got, again, want in list(zip(cached.scores, recomputed.scores, alone.scores))[:steps]:
        assert got.shape[0] == 4
        assert torch.allclose(got[2:], want, rtol=1e-4, atol=1e-4)
        assert torch.allclose(again[2:], want, rtol=1e-4, atol=1e-4)


def test_generate_with_a_head_layer_without_a_cache_argument(overconfident_lm, monkeypatch):
    """A transformers whose decoder layer takes no KV cache: the head runs on every position at each step."""
    base, calib, _ = overconfident_lm
    cal = _random_head(base, "transformer")
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    prompt = calib[:2, :6]
    want = base.generate(prompt, logits_processor=[cal.logits_processor()], **kw)
    monkeypatch.setattr(cal.head, "cache_argument", lambda: None)
    got = cal.generate(prompt, **kw)
    for a, b in zip(got.scores, want.scores):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_generate_under_beam_search_equals_the_recomputing_processor(overconfident_lm):
    """Beam search reorders its beams: a step whose rows do not extend the last step's is recomputed."""
    base, calib, _ = overconfident_lm
    cal = _random_head(base, "transformer")
    kw = dict(max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    prompt = calib[:2, :6]
    got, want = cal.generate(prompt, **kw), base.generate(prompt, logits_processor=[cal.logits_processor()], **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):  # every beam's calibrated scores, step by step
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_train_ats_with_trainer_checkpoints_and_cli(shared_data, tmp_path):
    from hf_lsce.ats.training import alpaca_prompt, load_instruction_records, train_ats
    from hf_lsce.cli import main
    from hf_lsce.tokenizer import train_bpe_tokenizer

    path = os.path.join(shared_data, "alpaca", "alpaca_en_demo.json")
    recs = load_instruction_records(path, limit=40)
    assert recs[0]["prompt"].startswith("Below is an instruction") and recs[0]["prompt"].endswith("### Response:\n")
    tok = train_bpe_tokenizer([r["prompt"] + r["completion"] for r in recs], vocab_size=600)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(_tiny_config(vocab_size=len(tok), max_position_embeddings=512))
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    cal = train_ats(base, tok, path, output_dir=str(tmp_path / "ats"), head_type="mlp", max_steps=4, limit=40,
                    per_device_train_batch_size=2, max_length=128, save_steps=2, logging_steps=1)
    assert (tmp_path / "ats" / "checkpoint-4").is_dir() and (tmp_path / "ats" / "model.safetensors").exists()
    restored = ATSCalibrator.from_pretrained(tmp_path / "ats")  # the base from the saved config
    ids = torch.tensor([tok(alpaca_prompt("Say hi")).input_ids])
    with torch.no_grad():
        assert torch.allclose(restored(ids).logits, cal(ids).logits)
    # resume continues from the last checkpoint to a later step
    train_ats(base, tok, path, output_dir=str(tmp_path / "ats"), head_type="mlp", max_steps=6, limit=40,
              per_device_train_batch_size=2, max_length=128, save_steps=2, resume_from_checkpoint=True)
    state = json.loads((tmp_path / "ats" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    with pytest.raises(ValueError, match="expected instruction/input/output"):
        load_instruction_records([{"text": "x"}])
    # the command line, then an eval of the trained head through hf-lsce eval
    argv = ["train-ats", "--model", str(tmp_path / "base"), "--data", path, "--head", "linear", "--max-steps", "2",
            "--limit", "8", "--max-length", "96", "--output-dir", str(tmp_path / "cli"), "--dtype", "fp32"]
    assert main(argv) == 0
    assert main(argv) == 2  # the trained head is not replaced without --overwrite
    assert main(["eval", "--model", str(tmp_path / "cli"), "--tasks", "arc_easy", "--data-dir", shared_data,
                 "--limit", "3", "--output-dir", str(tmp_path / "ev"), "--dtype", "fp32", "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "ev" / "calibration.json").read_text())["tasks"]["arc_easy"]["n"] == 3


@pytest.mark.parametrize("family", ["cohere", "granite"])
def test_a_base_that_scales_its_logits_is_calibrated_from_its_own_logits(family):
    """Cohere multiplies its logits by logit_scale, Granite divides them by logits_scaling: ATS scales the base's own
    logits (temperature 1 gives them back exactly), and the fused loss equals the materialised one."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from tiny_models import tiny_model

    base = tiny_model(family).eval()
    cal = ATSCalibrator.from_base(base, head_type="scalar").eval()
    ids = torch.randint(3, base.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(cal(ids).logits, base(ids).logits.float(), rtol=1e-5, atol=1e-6)
        cal.head.log_scale.fill_(0.7)  # temperature 1 / e^0.7
        assert torch.allclose(cal(ids).logits, base(ids).logits.float() * math.exp(0.7), rtol=1e-5, atol=1e-5)
    cal.train()
    fused = cal(ids, labels=ids).loss
    cal.loss_path = "materialise"
    assert float(cal(ids, labels=ids).loss.detach()) == pytest.approx(float(fused.detach()), rel=1e-5)


def test_fp32_head_copy_follows_the_head_not_its_address():
    """The fused ATS loss keeps an fp32 copy of a frozen fp16 head. A different head at the same address and version
    (what CUDA's caching allocator gives a model loaded after another was freed; here a second view of one buffer
    written through .data, which bumps no version) gets its own copy; the same head reuses it. Mutation check: the
    address and version alone as the key fail."""
    from hf_lsce.ats.loss import _fp32_copy

    buf = torch.randn(40, 8).half()
    first = buf.view(40, 8)
    copy = _fp32_copy(first)
    assert torch.equal(copy, first.float()) and _fp32_copy(first) is copy
    buf.data.copy_(torch.randn(40, 8).half())  # new values in place, versions unchanged
    second = buf.view(40, 8)
    assert second.data_ptr() == first.data_ptr() and second._version == first._version
    assert torch.equal(_fp32_copy(second), second.float())
