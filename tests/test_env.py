"""``hf-lsce env`` and the version floors: what a user on an old torch or Triton, or on a machine without a usable GPU,
gets. The kernels' own compatibility with each Triton: tools/triton_matrix.py (docs/limitations.md)."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from hf_lsce import linear_cross_entropy
from hf_lsce.cli import main
from hf_lsce.ops import config

lce_module = importlib.import_module("hf_lsce.ops.linear_cross_entropy")  # (the package exports its function)


def test_env_json_reports_versions_paths_and_a_passing_self_test(capsys):
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    versions = info["versions"]
    assert versions["torch"] == torch.__version__ and versions["Python"] == ".".join(map(str, sys.version_info[:3]))
    assert {"Triton", "transformers", "TRL", "PEFT", "accelerate", "DeepSpeed", "Axolotl", "LLaMA-Factory"} <= set(
        versions)
    assert info["device"] == "cpu" and info["gpus"] == [] and ("CPU build" in info["cuda"] or "no usable GPU" in
                                                               info["cuda"])
    # the CPU takes the chunked torch path for every dtype and head, and the self-test checks each against fp64
    assert len(info["routes"]) == 6 and {r["path"] for r in info["routes"]} == {"torch"}
    assert len(info["self_test"]) == 15 and info["passed"] is True  # (6 heads x 2 budgets, 3 evaluations)
    for check in info["self_test"]:
        assert check["ok"], check
        for key, err in check["errors"].items():
            assert err <= check.get("bounds", {}).get(key, 1e-4), check


def test_env_text_and_exit_status_1_when_the_op_is_wrong(capsys, monkeypatch):
    import hf_lsce.ops as ops

    assert main(["env", "--no-self-test"]) == 0
    out = capsys.readouterr().out
    assert "training computation on cpu" in out and "self-test" not in out
    real = ops.linear_cross_entropy

    def off_by_a_percent(*args, **kwargs):  # an op whose loss is 1 % off: the self-test must catch it
        out = real(*args, **kwargs)
        return out * 1.01 if torch.is_tensor(out) else (out[0] * 1.01, *out[1:])

    monkeypatch.setattr(ops, "linear_cross_entropy", off_by_a_percent)
    assert main(["env"]) == 1
    out = capsys.readouterr().out
    assert "FAIL bf16 trainable, memory=auto" in out and "self-test: FAILED" in out


def test_env_with_a_broken_cuda_says_why_and_tests_the_torch_path(capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")

    def broken():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040)")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert main(["env", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cuda"].startswith("CUDA does not initialise: The NVIDIA driver on your system is too old")
    assert info["device"] == "cpu" and info["passed"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["env", "--no-self-test", "--json"]) == 0
    assert "CUDA 12.4 build, but no usable GPU" in json.loads(capsys.readouterr().out)["cuda"]


@pytest.mark.parametrize("argv, match", [
    (["env", "--device", "cuda:0"], "--device cuda:0: "),
    (["env", "--head", "5"], "argument --head: expected D,V"),
    (["env", "--head", "0,100"], "argument --head: expected D >= 1"),
    (["env", "--tokens", "0"], "argument --tokens: must be at least 1"),
])
def test_env_bad_arguments_one_line(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_old_triton_takes_the_torch_path_with_one_warning(monkeypatch):
    """A Triton below the floor (the version the op reads, simulated): backend="auto" on a CUDA device resolves to the
    chunked torch path with one warning naming the Triton found and the one needed; explicitly asked for, the Triton
    backend runs, with one warning; the loss is exact (fp64 reference)."""
    monkeypatch.setattr(config, "triton_version", lambda: "3.2.0")  # (torch 2.6's)
    config.triton_problem.cache_clear()
    lce_module._triton_runs_on.cache_clear()
    lce_module._warn_untested_triton.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert lce_module._resolve_backend("auto", cuda) == "torch"
            assert lce_module._resolve_backend("auto", cuda) == "torch"
        msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1, msgs
        need = ".".join(map(str, config.TRITON_MIN))
        assert f"Triton 3.2.0 is older than the {need}" in msgs[0] and "chunked torch path" in msgs[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert lce_module._resolve_backend("triton", torch.device("cpu")) == "triton"  # (the interpreter)
            lce_module._resolve_backend("triton", torch.device("cpu"))
        assert len([w for w in caught if "backend='triton' was asked for" in str(w.message)]) == 1
    finally:
        config.triton_problem.cache_clear()
        lce_module._triton_runs_on.cache_clear()
        lce_module._warn_untested_triton.cache_clear()
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(50, 16, generator=g, dtype=torch.float64), torch.randn(300, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 300, (50,), generator=g)
    got = linear_cross_entropy(h.float(), w.float(), y, label_smoothing=0.1, backend="torch")
    ref = F.cross_entropy(h @ w.T, y, label_smoothing=0.1)
    assert abs(float(got) - float(ref)) < 1e-6 * float(ref)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_without_triton_the_package_imports_and_runs_the_torch_path():
    """Where Triton cannot be imported (macOS, Windows, a broken install), hf_lsce imports, the op and the patched
    model run the torch path, exactly (the model's loss equals HF's smoothed loss on its logits, and no logits are
    returned), and ``hf-lsce env`` says so."""
    r = _python(
        "import sys; sys.modules['triton'] = None\n"
        "import torch, torch.nn.functional as F\n"
        "from hf_lsce import linear_cross_entropy\n"
        "from hf_lsce.ops import config\n"
        "h, w = torch.randn(40, 8, dtype=torch.float64), torch.randn(100, 8, dtype=torch.float64)\n"
        "y = torch.randint(0, 100, (40,))\n"
        "got = linear_cross_entropy(h.float(), w.float(), y, label_smoothing=0.2)\n"
        "ref = F.cross_entropy(h @ w.T, y, label_smoothing=0.2)\n"
        "assert abs(float(got) - float(ref)) < 1e-5, (float(got), float(ref))\n"
        "print(config.triton_problem())\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from hf_lsce import apply_lsce_patch\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=2, num_key_value_heads=2))\n"
        "ids = torch.randint(0, 300, (2, 10))\n"
        "logits = m(ids).logits\n"
        "ref = F.cross_entropy(logits[:, :-1].reshape(-1, 300), ids[:, 1:].reshape(-1), label_smoothing=0.1)\n"
        "apply_lsce_patch(m, label_smoothing=0.1)\n"
        "out = m(ids, labels=ids)\n"
        "assert out.logits is None and abs(float(out.loss) - float(ref)) < 1e-5, (out.logits, float(out.loss))\n"
        "from hf_lsce.cli import main\n"
        "sys.exit(main(['env', '--no-self-test']))\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Triton is not importable here" in r.stdout


def test_torch_below_the_floor_fails_at_import_with_one_line():
    need = ".".join(map(str, config.TORCH_MIN))
    assert config.torch_problem(torch.__version__) is None
    r = _python("import torch; torch.__version__ = '2.4.1'\nimport hf_lsce\n")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last == (f"ImportError: hf_lsce needs torch >= {need} (the oldest it is tested on), found 2.4.1: "
                    f"pip install -U 'torch>={need}'"), last
