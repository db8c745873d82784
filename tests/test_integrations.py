"""The framework integrations' refusals and checks, and their real plugin API where the framework is importable.

Axolotl's plugin keys are validated by the plugin's pydantic model (Axolotl merges it into its config model); that
model and the LLaMA-Factory route's config check need neither framework, so they run in CI. Where Axolotl is
installed (tools/version_matrix.py's Axolotl set), the plugin is checked on Axolotl's own BasePlugin and config
validation, and it patches a real model. End-to-end runs of each framework's own CLI: tools/frameworks_e2e.py.
"""
from __future__ import annotations

import pytest
import torch

from hf_lsce.integrations.axolotl_args import LsceArgs
from hf_lsce.integrations.llamafactory import check_config
from hf_lsce.patching import versions


@pytest.mark.parametrize("data, match", [
    (dict(lsce_label_smoothing="0.1"), "lsce_label_smoothing must be None or a float in .*, got '0.1' \\(str\\)"),
    (dict(lsce_label_smoothing=True), "lsce_label_smoothing must be None or a float .* \\(bool\\)"),
    (dict(lsce_label_smoothing=1.5), "lsce_label_smoothing must be None or a float in \\[0, 1\\], got 1.5"),
    (dict(label_smoothing_factor=-0.1), "label_smoothing_factor must be None or a float in \\[0, 1\\], got -0.1"),
    (dict(lsce="yes"), "lsce must be true or false"),
    (dict(lsce_fused_eval_loss=1), "lsce_fused_eval_loss must be true or false"),
    (dict(cut_cross_entropy=True), "Cut Cross-Entropy .* both replace the training loss; keep one: remove cut_cross"),
    (dict(liger_fused_linear_cross_entropy=True), "Liger's fused linear cross-entropy .* remove liger_fused_linear"),
])
def test_axolotl_keys_refused_with_one_line_naming_the_key(data, match):
    with pytest.raises(ValueError, match=match) as e:
        LsceArgs.model_validate(data)
    (err,) = e.value.errors()
    assert "\n" not in err["msg"]


def test_axolotl_keys_accepted():
    keys = LsceArgs.model_validate(dict(lsce_label_smoothing=0.1, label_smoothing_factor=0.2))
    assert keys.lsce_label_smoothing == 0.1
    assert LsceArgs.model_validate(dict(lsce=False, cut_cross_entropy=True)).lsce is False  # off: no conflict
    assert LsceArgs.model_validate(dict(liger_fused_linear_cross_entropy=False, liger_rms_norm=True)).lsce is None


@pytest.mark.parametrize("cfg, model_type, match", [
    (dict(stage="dpo"), None, "stage: 'dpo'"),
    (dict(label_smoothing_factor=2), None, "label_smoothing_factor must be None or a float in \\[0, 1\\], got 2"),
    (dict(label_smoothing_factor="0.1"), None, "label_smoothing_factor must be None or a float .* \\(str\\)"),
    (dict(enable_liger_kernel=True), None, "enable_liger_kernel: true replaces the training loss"),
    (dict(use_asft_loss=True), None, "use_asft_loss: true"),
    (dict(stage="sft"), "bert", "model type 'bert' .* is not in hf_lsce's table"),
])
def test_llamafactory_config_refused(cfg, model_type, match):
    with pytest.raises(ValueError, match=match):
        check_config(cfg, model_type)


def test_llamafactory_config_accepted():
    check_config(dict(stage="sft", label_smoothing_factor=0.1, finetuning_type="lora"), "llama")
    check_config(dict(stage="pt"), "qwen2")


def test_llamafactory_route_refuses_a_missing_framework_before_reading_the_config(monkeypatch, tmp_path):
    from hf_lsce.integrations import llamafactory

    monkeypatch.setattr(versions, "installed_version", lambda name: None if name == "llamafactory" else "99")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("label_smoothing_factor: 0.1\n")
    with pytest.raises(SystemExit, match="LLaMA-Factory is not installed"):
        llamafactory.main(["train", str(cfg)])
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.9.4" if name == "llamafactory" else "99")
    with pytest.raises(SystemExit, match="needs llamafactory >= 0.9.5 .* found 0.9.4"):
        llamafactory.main(["train", str(cfg)])
    assert cfg.read_text() == "label_smoothing_factor: 0.1\n"  # the user's file untouched


def test_versions_below_the_floor_refused_with_found_and_needed(monkeypatch):
    from hf_lsce import apply_lsce_patch
    from tiny_models import tiny_model

    monkeypatch.setattr(versions, "installed_version", lambda name: {"transformers": "4.50.0"}.get(name, "99.0"))
    versions._problems.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"needs transformers >= 4\.57\.1 .* found 4\.50\.0: pip install -U"):
            apply_lsce_patch(tiny_model("llama"))
        monkeypatch.setattr(versions, "installed_version", lambda name: {"trl": "0.19.1"}.get(name, "99.0"))
        versions._problems.cache_clear()
        with pytest.raises(ImportError, match=r"needs trl >= 0\.24\.0 .* found 0\.19\.1"):
            apply_lsce_patch()
        monkeypatch.setattr(versions, "installed_version", lambda name: None if name == "trl" else "99.0")
        versions._problems.cache_clear()
        apply_lsce_patch(tiny_model("llama"))  # TRL is optional
    finally:
        versions._problems.cache_clear()
        from hf_lsce import revert_lsce_patch

        revert_lsce_patch()


def test_axolotl_plugin_without_axolotl_says_so_in_one_line():
    try:
        import axolotl  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="plugin for Axolotl, which is not importable here.*pip install"):
            import hf_lsce.integrations.axolotl  # noqa: F401
    else:
        pytest.skip("Axolotl is installed: the plugin imports")


# ------------------------------------------------------------------ on Axolotl itself, where it is installed
def _axolotl():
    pytest.importorskip("axolotl", reason="Axolotl is not installed (tools/version_matrix.py runs these)")
    from hf_lsce.integrations import axolotl as plugin

    return plugin


def test_plugin_is_axolotls_own_and_its_keys_join_axolotls_config(tmp_path):
    plugin = _axolotl()
    from axolotl.integrations.base import BasePlugin, PluginManager
    from axolotl.integrations.config import merge_input_args

    assert issubclass(plugin.LscePlugin, BasePlugin)
    manager = PluginManager.get_instance()
    manager.register("hf_lsce.integrations.axolotl.LscePlugin")
    try:
        _, input_config = merge_input_args()
        assert {"lsce", "lsce_label_smoothing", "lsce_fused_eval_loss"} <= set(input_config.model_fields)
        with pytest.raises(ValueError, match="lsce_label_smoothing must be None or a float in \\[0, 1\\]"):
            input_config.model_validate(dict(base_model="x", lsce_label_smoothing=3.0))
        with pytest.raises(ValueError, match="keep one: remove cut_cross_entropy"):
            input_config.model_validate(dict(base_model="x", cut_cross_entropy=True, bf16=True))
    finally:
        manager.plugins.pop("hf_lsce.integrations.axolotl.LscePlugin", None)


def test_plugin_refuses_a_family_outside_the_table_and_patches_the_built_model():
    plugin = _axolotl()
    from axolotl.utils.dict import DictDefault

    from hf_lsce import is_patched, revert_lsce_patch
    from hf_lsce.patching.forward import ENGAGEMENT
    from tiny_models import TokenRows, tiny_model

    p = plugin.LscePlugin()
    with pytest.raises(ValueError, match="does not support model type 'bert'"):
        p.pre_model_load(DictDefault(model_config_type="bert"))
    p.pre_model_load(DictDefault(model_config_type="llama"))
    model = tiny_model("llama").train()
    p.post_model_load(DictDefault(lsce_label_smoothing=0.1), model)
    try:
        assert is_patched(model) and model._lsce_label_smoothing == 0.1
        rows = TokenRows(4).rows
        ids, lab = torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])
        before = ENGAGEMENT.fused_calls
        assert model(input_ids=ids, labels=lab).logits is None and ENGAGEMENT.fused_calls == before + 1
        off = tiny_model("llama")
        p.post_model_load(DictDefault(lsce=False), off)
        assert not is_patched(off)
    finally:
        revert_lsce_patch(model)


def test_hf_lsce_llamafactory_command_refuses_in_one_line(monkeypatch, tmp_path, capsys):
    """The command line's route: a user error is one line on stderr and exit status 2, nothing run."""
    from hf_lsce.cli import main

    monkeypatch.setattr(versions, "installed_version", lambda name: None if name == "llamafactory" else "99")
    assert main(["llamafactory", "train", str(tmp_path / "cfg.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-lsce llamafactory: LLaMA-Factory is not installed") and "\n" not in err
    assert main(["llamafactory", "evaluate", "cfg.yaml"]) == 2
    assert "only 'train CONFIG.yaml' is routed" in capsys.readouterr().err
