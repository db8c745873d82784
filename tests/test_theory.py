"""The entropy lower bound (hf_lsce.theory) against direct numerical minimisation, and `hf-lsce diagnose`."""
import json
import math

import pytest
import torch

from hf_lsce import theory


def _entropy(z: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(z, -1)
    return -(lp.exp() * lp).sum(-1)


def _minimise_on_sphere(v: int, r: float, starts: int = 128, steps: int = 800) -> float:
    """Smallest entropy gradient descent finds over centred logits of norm exactly r (random restarts)."""
    g = torch.Generator().manual_seed(v * 1000 + int(10 * r))
    u = torch.randn(starts, v, dtype=torch.float64, generator=g).requires_grad_()
    opt = torch.optim.Adam([u], lr=0.05)
    for _ in range(steps):
        c = u - u.mean(1, keepdim=True)
        h = _entropy(r * c / c.norm(dim=1, keepdim=True))
        opt.zero_grad()
        h.sum().backward()
        opt.step()
    return float(h.detach().min())


@pytest.mark.parametrize("d", [64, 576, 2304, 4096])
@pytest.mark.parametrize("v", [2, 50, 32_000, 256_000])
@pytest.mark.parametrize("rho", [0.001, 0.02, 0.2])
def test_bound_is_the_papers_theorem_4_2(d, v, rho):
    """entropy_lower_bound against the paper's Theorem 4.2 (Eq. 14), written out here, and against the entropy of its
    minimiser (Eq. 36: one logit a, V - 1 logits b) computed directly; rho as the paper's sigma_C sigma_h."""
    gamma = math.exp(-rho * math.sqrt(d * v / (v - 1)))
    eq14 = math.log(1 + (v - 1) * gamma) + rho * gamma * math.sqrt(d * v * (v - 1)) / (1 + (v - 1) * gamma)
    ours = theory.entropy_lower_bound(d, v, rho)
    assert ours == pytest.approx(eq14, rel=1e-9, abs=1e-300)  # (Eq. 14 as written: log(1 + x), not log1p)
    if v <= 50_000:
        a = rho * math.sqrt(d) * math.sqrt(1 - 1 / v)
        b = -rho * math.sqrt(d) * math.sqrt(1 / (v * (v - 1)))
        z = torch.full((v,), b, dtype=torch.float64)
        z[0] = a
        assert float(z.norm()) == pytest.approx(rho * math.sqrt(d), rel=1e-12)  # on the lemma's sphere
        assert float(_entropy(z)) == pytest.approx(ours, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("v", [2, 3, 5, 8])
@pytest.mark.parametrize("r", [0.3, 1.0, 2.5, 6.0, 12.0])
def test_bound_is_the_numerical_minimum(v, r):
    found = _minimise_on_sphere(v, r)
    bound = theory.min_entropy(v, r)
    assert found >= bound - 1e-9  # nothing below the bound
    assert found <= bound + 1e-6 * max(1.0, bound) + 1e-12  # and it is reached: the bound is tight


def test_no_random_logits_below_the_bound():
    g = torch.Generator().manual_seed(0)
    for v in (3, 7, 50, 1000):
        z = torch.randn(4096, v, dtype=torch.float64, generator=g) * torch.rand(4096, 1, dtype=torch.float64, generator=g) * 8
        z[:64, 0] += 30  # a few very peaked rows
        r = (z - z.mean(1, keepdim=True)).norm(dim=1)
        bounds = torch.tensor([theory.min_entropy(v, float(x)) for x in r], dtype=torch.float64)
        assert bool((_entropy(z) >= bounds - 1e-10).all())


@pytest.mark.parametrize("d,v", [(4, 9), (16, 12), (3, 40)])
def test_head_bound_holds_for_a_real_head(d, v):
    """min over ||h|| <= RMS*sqrt(D) of H(softmax(W h)) is never below entropy_lower_bound(D, V, ||W||_2 RMS)."""
    g = torch.Generator().manual_seed(d * v)
    w = torch.randn(v, d, dtype=torch.float64, generator=g) * 0.7
    rms = 1.3
    rho = float(torch.linalg.matrix_norm(w, ord=2)) * rms
    u = torch.randn(64, d, dtype=torch.float64, generator=g).requires_grad_()
    opt = torch.optim.Adam([u], lr=0.05)
    for _ in range(600):
        h = rms * math.sqrt(d) * u / u.norm(dim=1, keepdim=True)
        ent = _entropy(h @ w.T)
        opt.zero_grad()
        ent.sum().backward()
        opt.step()
    assert float(ent.detach().min()) >= theory.entropy_lower_bound(d, v, rho) - 1e-9


def test_bound_is_attained_when_the_head_can_point_anywhere():
    """With D >= V and W = s * [I | 0], the one-vs-rest logits are reachable: the bound is exact."""
    v, d, s, rms = 6, 8, 2.0, 0.5
    w = torch.zeros(v, d, dtype=torch.float64)
    w[:, :v] = s * torch.eye(v, dtype=torch.float64)
    r = rms * math.sqrt(d)
    c = torch.full((v,), -1.0 / v, dtype=torch.float64)
    c[0] += 1
    h = torch.zeros(d, dtype=torch.float64)
    h[:v] = c / c.norm() * r  # ||h|| = RMS * sqrt(D); W h = s * h[:V] is centred already
    assert float(_entropy(w @ h)) == pytest.approx(theory.entropy_lower_bound(d, v, s * rms), rel=1e-12)


@pytest.mark.parametrize("v,cap", [(3, 0.5), (5, 2.0), (8, 4.0)])
def test_softcap_bound_is_the_numerical_minimum(v, cap):
    g = torch.Generator().manual_seed(v)
    u = (3 * torch.randn(128, v, dtype=torch.float64, generator=g)).requires_grad_()
    opt = torch.optim.Adam([u], lr=0.05)
    for _ in range(1500):
        ent = _entropy(cap * torch.tanh(u))
        opt.zero_grad()
        ent.sum().backward()
        opt.step()
    bound = theory.min_entropy_capped(v, cap)
    assert bound - 1e-9 <= float(ent.detach().min()) <= bound + 1e-4


def test_smoothed_target_entropy_matches_the_target_vector():
    for b, v in [(0.1, 7), (0.3, 100), (1.0, 11), (0.05, 256_000)]:
        t = torch.full((v,), b / v, dtype=torch.float64)
        t[0] += 1 - b
        assert theory.smoothed_target_entropy(b, v) == pytest.approx(float(-(t * t.log()).sum()), rel=1e-12)
    assert theory.smoothed_target_entropy(0.0, 10) == 0.0


def test_gap_grows_with_hidden_size_and_falls_with_vocabulary():
    """Figure 4's shape: wider heads can be more confident; larger vocabularies less."""
    rho = 0.2
    for v in (32_000, 128_256, 256_000):
        gaps = [theory.normalized_entropy_gap(d, v, rho) for d in (512, 1024, 2048, 3072, 4096, 8192)]
        assert all(0 <= a <= b <= 1 for a, b in zip(gaps, gaps[1:]))
    for d in (2048, 3072, 4096):
        gaps = [theory.normalized_entropy_gap(d, v, rho) for v in (32_000, 128_256, 256_000)]
        assert gaps[0] > gaps[1] > gaps[2]


def test_spectral_norm_matches_torch():
    w = torch.randn(500, 40, generator=torch.Generator().manual_seed(1))
    assert theory.spectral_norm(w) == pytest.approx(float(torch.linalg.matrix_norm(w, ord=2)), rel=1e-4)


def test_verdicts():
    # a narrow head over a large vocabulary cannot beat the smoothed target: smoothing changes little
    low = theory.diagnose(256, 256_000, 0.2, 0.1)
    assert low.entropy_bound >= low.smoothed_target_entropy and "change little" in low.verdict
    high = theory.diagnose(4096, 32_000, 1.0, 0.1)
    assert high.entropy_bound < high.smoothed_target_entropy and "can act" in high.verdict


@pytest.mark.parametrize("kwargs,match", [
    (dict(hidden_size=0, vocab_size=10, rho=1.0), "hidden_size"),
    (dict(hidden_size=8, vocab_size=2.5, rho=1.0), "vocab_size"),
    (dict(hidden_size=8, vocab_size=10, rho=-1.0), "rho"),
    (dict(hidden_size=8, vocab_size=10, rho=float("nan")), "rho"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        theory.entropy_lower_bound(**kwargs)
    with pytest.raises(ValueError, match="label_smoothing"):
        theory.smoothed_target_entropy(1.5, 10)


def test_cli_diagnose(tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_lsce.cli import main
    from hf_lsce.tokenizer import train_bpe_tokenizer

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = AutoModelForCausalLM.from_config(cfg)
    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text("the lazy dog sleeps\n\nthe quick fox runs over the hill")
    out = tmp_path / "d.json"
    assert main(["diagnose", str(tmp_path / "m"), "--bound-only", "--text-file", str(text), "--json", str(out),
                 "--plot", str(tmp_path / "gap.png")]) == 0
    d = json.loads(out.read_text())
    # rho independently: spectral norm (torch) x the largest RMS of the final hidden states on the same text
    model.eval()
    rms = 0.0
    with torch.no_grad():
        for t in ("the lazy dog sleeps", "the quick fox runs over the hill"):
            hs = model(**tok(t, return_tensors="pt"), output_hidden_states=True).hidden_states[-1][0]
            rms = max(rms, float(hs.pow(2).mean(-1).sqrt().max()))
    expected = float(torch.linalg.matrix_norm(model.lm_head.weight.detach(), ord=2)) * rms
    assert d["rho"] == pytest.approx(expected, rel=1e-4)
    assert d["entropy_bound"] == pytest.approx(theory.entropy_lower_bound(32, 300, expected), rel=1e-3)
    assert d["observed"]["min_entropy"] >= d["entropy_bound"] - 1e-6  # the model obeys its own bound
    assert (tmp_path / "gap.png").stat().st_size > 0
    assert "normalised entropy gap" in capsys.readouterr().out
    assert main(["diagnose", str(tmp_path / "m" / "config.json")]) == 0
    assert "at initialisation" in capsys.readouterr().out
