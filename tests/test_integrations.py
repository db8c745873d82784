"""The framework integrations' refusals and checks, and their real plugin API where the framework is importable.

Axolotl's plugin keys are validated by the plugin's pydantic model (Axolotl merges it into its config model); that
model and the LLaMA-Factory route's config check need neither framework, so they run in CI. Where Axolotl is
installed (tools/version_matrix.py's Axolotl set), the plugin is checked on Axolotl's own BasePlugin and config
validation, and it patches a real model. End-to-end runs of each framework's own CLI: tools/frameworks_e2e.py.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

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
    (dict(lsce=False, label_smoothing_factor=0.1), "label_smoothing_factor: 0.1 with lsce: false would train "
     "unsmoothed: Axolotl has no label smoothing .* Set lsce: true, or remove label_smoothing_factor"),
    (dict(lsce=False, lsce_label_smoothing=0.2), "lsce_label_smoothing: 0.2 with lsce: false"),
    (dict(lsce_memory="fast"), "lsce_memory='fast' was retired in 1.0"),
    (dict(lsce_memory="plenty"), "lsce_memory must be 'auto', 'low' or a number of bytes, got 'plenty'"),
    (dict(lsce_memory=-1), "lsce_memory=-1: a budget is a positive number of bytes"),
    (dict(lsce_memory=True), "lsce_memory must be 'auto', 'low' or a number of bytes, got True \\(bool\\)"),
])
def test_axolotl_keys_refused_with_one_line_naming_the_key(data, match):
    with pytest.raises(ValueError, match=match) as e:
        LsceArgs.model_validate(data)
    (err,) = e.value.errors()
    assert "\n" not in err["msg"]


@pytest.mark.parametrize("data, match", [
    (dict(lsce_calibration_tasks="arc_eazy", val_set_size=0.1), "lsce_calibration_tasks: unknown task names "
     "\\['arc_eazy'\\].*did you mean 'arc_easy'"),
    (dict(lsce_calibration_tasks=3, val_set_size=0.1), "lsce_calibration_tasks: tasks must be a comma-separated"),
    (dict(lsce_calibration_tasks="mmlu", lsce_calibration_limit="ten", val_set_size=0.1),
     "lsce_calibration_limit must be a whole number .* got 'ten' \\(str\\)"),
    (dict(lsce_calibration_tasks="mmlu", lsce_calibration_limit=0, val_set_size=0.1), "lsce_calibration_limit must"),
    (dict(lsce_calibration_tasks="mmlu", lsce_calibration_data_dir="/no/such/folder", val_set_size=0.1),
     "lsce_calibration_data_dir: no such folder: /no/such/folder"),
    (dict(lsce_calibration_tasks="mmlu", lsce_calibration_diagrams="yes", val_set_size=0.1),
     "lsce_calibration_diagrams must be true or false"),
    (dict(lsce_calibration_task="mmlu"), "lsce_calibration_task is not a calibration key of hf_lsce"),
    (dict(lsce_calibration_limit=50), "lsce_calibration_limit is set but lsce_calibration_tasks is not"),
    (dict(lsce_calibration_tasks="mmlu"), "scores the model at each evaluation, and this config has none: set "
                                          "val_set_size"),
])
def test_axolotl_calibration_keys_refused_with_one_line_naming_the_key(data, match):
    with pytest.raises(ValueError, match=match) as e:
        LsceArgs.model_validate(data)
    (err,) = e.value.errors()
    assert "\n" not in err["msg"]


def test_axolotl_keys_accepted():
    keys = LsceArgs.model_validate(dict(lsce_label_smoothing=0.1, label_smoothing_factor=0.2))
    assert keys.lsce_label_smoothing == 0.1
    assert LsceArgs.model_validate(dict(lsce=False, cut_cross_entropy=True)).lsce is False  # off: no conflict
    assert LsceArgs.model_validate(dict(lsce=False, label_smoothing_factor=0.0)).lsce is False  # b = 0 asked: fine
    assert LsceArgs.model_validate(dict(liger_fused_linear_cross_entropy=False, liger_rms_norm=True)).lsce is None


@pytest.mark.parametrize("yaml_keys, ds, refused", [
    (dict(bf16=True), {"bf16": {"enabled": "auto"}}, "bf16: true with the DeepSpeed ZeRO-3 config .*, whose "
     "bf16.enabled is 'auto': .* trains in fp32 .* set \"bf16\": {\"enabled\": true} in "),
    (dict(bf16=True), {}, "whose bf16.enabled is 'unset'"),
    (dict(fp16=True), {"fp16": {"enabled": "auto"}}, "fp16: true with the DeepSpeed ZeRO-3 config"),
    (dict(bf16=True), {"bf16": {"enabled": True}}, None),
    (dict(bf16=False), {"bf16": {"enabled": "auto"}}, None),  # fp32 asked: "auto" read as off is what it asked
    (dict(bf16=True), {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}, None),  # not ZeRO-3
])
def test_axolotl_zero3_config_that_would_train_in_fp32_is_refused(tmp_path, yaml_keys, ds, refused):
    """A bf16 YAML with a ZeRO-3 config leaving bf16 "auto": Axolotl loads the model before the Trainer fills "auto",
    and DeepSpeed's own parser (the installed one) reads an unfilled "auto" as off, so the weights would be fp32. The
    plugin refuses in one line naming the file and the key; the shipped example passes."""
    from deepspeed.runtime.precision_config import get_bfloat16_config

    from hf_lsce.integrations.axolotl_args import deepspeed_precision_problem

    assert get_bfloat16_config({"bf16": {"enabled": "auto"}}).enabled is False  # the premise, in DeepSpeed itself
    conf = {"zero_optimization": {"stage": 3}, **ds}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(conf))
    for deepspeed in (str(path), conf):  # Axolotl's key: a file, or the mapping itself
        problem = deepspeed_precision_problem(dict(yaml_keys, deepspeed=deepspeed))
        if refused is None:
            assert problem is None
        else:
            assert re.search(refused, problem) and "\n" not in problem
    assert deepspeed_precision_problem(dict(bf16=True, deepspeed=str(tmp_path / "missing.json"))) is None
    assert deepspeed_precision_problem(dict(bf16=True)) is None
    example = Path(__file__).resolve().parents[1] / "examples" / "axolotl" / "zero3_bf16.json"
    assert deepspeed_precision_problem(dict(bf16=True, deepspeed=str(example))) is None


@pytest.mark.parametrize("cfg, model_type, match", [
    (dict(stage="dpo"), None, "stage: 'dpo'"),
    (dict(label_smoothing_factor=2), None, "label_smoothing_factor must be None or a float in \\[0, 1\\], got 2"),
    (dict(label_smoothing_factor="0.1"), None, "label_smoothing_factor must be None or a float .* \\(str\\)"),
    (dict(use_asft_loss=True), None, "use_asft_loss: true"),
    (dict(stage="sft"), "bert", "model type 'bert' .* is not in hf_lsce's table"),
    (dict(lsce_memory="plenty"), None, "lsce_memory must be 'auto', 'low' or a number of bytes, got 'plenty'"),
    (dict(lsce_memory=0), None, "lsce_memory=0: a budget is a positive number of bytes"),
])
def test_llamafactory_config_refused(cfg, model_type, match):
    with pytest.raises(ValueError, match=match):
        check_config(cfg, model_type)


def test_llamafactory_liger_kernels_need_liger_installed(monkeypatch):
    """enable_liger_kernel: true is taken (Liger's other kernels, hf_lsce's loss) where liger-kernel is installed, and
    refused in one line naming the key where it is not."""
    from hf_lsce.patching import versions

    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.8.1" if name == "liger-kernel" else real(name))
    check_config(dict(enable_liger_kernel=True), "llama")
    monkeypatch.setattr(versions, "installed_version", lambda name: None if name == "liger-kernel" else real(name))
    with pytest.raises(ValueError, match="^enable_liger_kernel: true asks for Liger-Kernel's kernels, and liger-kernel "
                                         "is not installed: pip install liger-kernel") as e:
        check_config(dict(enable_liger_kernel=True), "llama")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cfg, match", [
    (dict(lsce_calibration_tasks="arc_easy"), "this config has none: set eval_strategy: steps"),
    (dict(lsce_calibration_tasks="arc_easy", eval_strategy="steps"), "this config has none"),
    (dict(lsce_calibration_tasks="arc_easy", val_size=0.1, eval_strategy="no"), "this config has none"),
    (dict(lsce_calibration_tasks=["mmlu", 7], val_size=0.1, eval_strategy="steps"), "task names must be strings"),
    (dict(lsce_calibration_diagrams=True), "lsce_calibration_diagrams is set but lsce_calibration_tasks is not"),
])
def test_llamafactory_calibration_keys_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        check_config(cfg)


def test_calibration_keys_load_their_tasks_before_training(shared_data, tmp_path):
    """The keys give a CalibrationCallback whose sets are loaded now (a file missing inside the folder: one line
    naming the key, before any model loads)."""
    from hf_lsce.integrations.calibration_keys import calibration_callback

    cb = calibration_callback(dict(lsce_calibration_tasks="arc_easy,mmlu", lsce_calibration_limit=6,
                                   lsce_calibration_data_dir=shared_data, lsce_calibration_diagrams=False))
    assert [(t.name, len(t)) for t in cb.tasks] == [("arc_easy", 6), ("mmlu", 6)] and cb.save_diagrams is False
    assert calibration_callback(dict(lsce_calibration_tasks=None)) is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="^lsce_calibration_tasks: .*arc") as e:
        calibration_callback(dict(lsce_calibration_tasks="arc_easy", lsce_calibration_data_dir=str(tmp_path / "empty")))
    assert "\n" not in str(e.value)


def test_a_calibration_callback_given_to_the_trainer_logs_through_it(shared_data, tmp_path):
    """LLaMA-Factory's route hands the callback to the Trainer's constructor (its ``run_exp(callbacks=...)``), where it
    has no trainer to log through: the patch's hook on ``Trainer.train`` binds it, so the metrics reach ``trainer.log``
    (``report_to`` and the log history) at each evaluation, as ``.attach(trainer)`` would."""
    from transformers import Trainer, TrainingArguments

    from hf_lsce import apply_lsce_patch, revert_lsce_patch
    from hf_lsce.integrations.calibration_keys import calibration_callback
    from tiny_models import TokenRows, tiny_model, word_tokenizer

    tok = word_tokenizer()
    model = apply_lsce_patch(tiny_model("llama"), label_smoothing=0.1)
    cb = calibration_callback(dict(lsce_calibration_tasks="arc_easy", lsce_calibration_limit=4,
                                   lsce_calibration_data_dir=shared_data, lsce_calibration_diagrams=False))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                             eval_strategy="steps", eval_steps=1, logging_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no")
    rows = TokenRows(4)
    logged = []

    class Recorder(__import__("transformers").TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs))

    trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows, processing_class=tok,
                      callbacks=[cb, Recorder()])
    try:
        trainer.train()
    finally:
        revert_lsce_patch(model)
    assert cb.trainer is trainer
    calib_steps = [row["step"] for row in trainer.state.log_history if "eval_calib/arc_easy_ece" in row]
    assert calib_steps == [1, 2], trainer.state.log_history
    assert sum("eval_calib/arc_easy_acc" in row for row in logged) == 2  # through trainer.log, seen by every callback


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


def test_quantized_base_without_bitsandbytes_or_a_gpu_refused_naming_the_key(monkeypatch):
    """QLoRA (LLaMA-Factory's ``quantization_bit``; Axolotl's keys in the Axolotl set) where bitsandbytes or a CUDA GPU
    is missing: one line naming the key and what to do, before anything loads."""
    import importlib.util

    from hf_lsce.patching.versions import quantization_problem

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ValueError, match="^quantization_bit: 4 loads the base model through bitsandbytes, which is not "
                                         "installed: pip install bitsandbytes$"):
        check_config(dict(stage="sft", quantization_bit=4))
    check_config(dict(stage="sft", quantization_bit=4, quantization_method="hqq"))  # (not bitsandbytes: not ours)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "bitsandbytes" else real(
        name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert quantization_problem("adapter: qlora").startswith("adapter: qlora needs a CUDA GPU for bitsandbytes' 4- and "
                                                             "8-bit layers")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert quantization_problem("adapter: qlora") is None


def test_framework_newer_than_tested_refused_unless_asked(monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda name: {"axolotl": "0.22.1"}.get(name, "99.0"))
    problem = versions.environment_problem("axolotl", "0.19.0", "0.21.0")
    assert problem == ("hf_lsce's axolotl integration is tested with axolotl 0.19.0 to 0.21.0, found 0.22.1: pip "
                       "install 'axolotl<0.22', or set HF_LSCE_UNTESTED_FRAMEWORK=1 to try it untested")
    monkeypatch.setenv("HF_LSCE_UNTESTED_FRAMEWORK", "1")
    assert versions.environment_problem("axolotl", "0.19.0", "0.21.0") is None
    monkeypatch.delenv("HF_LSCE_UNTESTED_FRAMEWORK")
    monkeypatch.setattr(versions, "installed_version", lambda name: {"axolotl": "0.21.3"}.get(name, "99.0"))
    assert versions.environment_problem("axolotl", "0.19.0", "0.21.0") is None  # (a patch release of the newest)


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


def test_label_smoothing_factor_in_the_yaml_reaches_the_op():
    """Axolotl's own config (0.19 to 0.21) has no ``label_smoothing_factor`` and drops it in validation, so a YAML's
    ``label_smoothing_factor: 0.1`` trained at b = 0 (with the plugin too, before it declared the key). Through
    Axolotl's own validation with the plugin listed the value survives, and the model the plugin patches smooths
    with it: its loss equals HF's smoothed loss at 0.1, not the unsmoothed one."""
    plugin = _axolotl()
    import yaml
    from axolotl.integrations.base import PluginManager
    from axolotl.utils.config import validate_config
    from axolotl.utils.dict import DictDefault

    from hf_lsce import revert_lsce_patch
    from tiny_models import tiny_model

    example = Path(__file__).resolve().parents[1] / "examples" / "axolotl" / "lsce_llama_lora.yml"
    manager = PluginManager.get_instance()
    manager.register("hf_lsce.integrations.axolotl.LscePlugin")
    try:
        cfg = validate_config(DictDefault(yaml.safe_load(example.read_text())))
    finally:
        manager.plugins.pop("hf_lsce.integrations.axolotl.LscePlugin", None)
    assert cfg.label_smoothing_factor == 0.1
    stock = tiny_model("llama").train()
    model = tiny_model("llama").train()
    plugin.LscePlugin().post_model_load(cfg, model)
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 100, (2, 12), generator=g)
        logits = stock(input_ids=ids).logits.float()[:, :-1].reshape(-1, stock.config.vocab_size)
        smoothed, plain = (torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1), label_smoothing=b)
                           for b in (0.1, 0.0))
        loss = model(input_ids=ids, labels=ids).loss
        assert abs(float(loss) - float(smoothed)) < 1e-5 * float(smoothed) and abs(float(smoothed) - float(plain)) > 1e-3
    finally:
        revert_lsce_patch(model)


def test_plugin_refuses_a_family_outside_the_table_and_patches_the_built_model(tmp_path):
    plugin = _axolotl()
    from axolotl.utils.dict import DictDefault

    from hf_lsce import is_patched, revert_lsce_patch
    from hf_lsce.patching.forward import ENGAGEMENT
    from tiny_models import TokenRows, tiny_model

    p = plugin.LscePlugin()
    with pytest.raises(ValueError, match="does not support model type 'bert'"):
        p.pre_model_load(DictDefault(model_config_type="bert"))
    ds = tmp_path / "zero3.json"  # Axolotl's zero3.json: bf16 "auto", under a bf16 YAML (fp32 weights, refused)
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}}))
    with pytest.raises(ValueError, match="^bf16: true with the DeepSpeed ZeRO-3 config .*zero3.json"):
        p.pre_model_load(DictDefault(model_config_type="llama", bf16=True, deepspeed=str(ds)))
    p.pre_model_load(DictDefault(model_config_type="llama"))
    model = tiny_model("llama").train()
    p.post_model_load(DictDefault(lsce_label_smoothing=0.1, lsce_memory="2e9"), model)
    try:
        assert is_patched(model) and model._lsce_label_smoothing == 0.1 and model._lsce_memory == "2000000000"
        rows = TokenRows(4).rows
        ids, lab = torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])
        before = ENGAGEMENT.fused_calls
        assert model(input_ids=ids, labels=lab).logits is None and ENGAGEMENT.fused_calls == before + 1
        off = tiny_model("llama")
        p.post_model_load(DictDefault(lsce=False), off)
        assert not is_patched(off)
    finally:
        revert_lsce_patch(model)


def test_plugin_attaches_the_calibration_callback_from_the_keys(shared_data, tmp_path):
    """On Axolotl's own classes: the calibration keys join Axolotl's config, the sets load before the model, and the
    callback the plugin gives Axolotl is bound to its trainer (metrics through ``trainer.log``)."""
    plugin = _axolotl()
    from axolotl.integrations.base import PluginManager
    from axolotl.integrations.config import merge_input_args
    from axolotl.utils.dict import DictDefault
    from transformers import Trainer, TrainingArguments

    from tiny_models import tiny_model

    keys = dict(lsce_calibration_tasks="arc_easy", lsce_calibration_limit=5, lsce_calibration_data_dir=shared_data,
                lsce_calibration_diagrams=False)
    manager = PluginManager.get_instance()
    manager.register("hf_lsce.integrations.axolotl.LscePlugin")
    try:
        _, input_config = merge_input_args()
        assert set(keys) <= set(input_config.model_fields)
        with pytest.raises(ValueError, match="lsce_calibration_limit must be a whole number"):
            input_config.model_validate(dict(base_model="x", val_set_size=0.1,
                                             **{**keys, "lsce_calibration_limit": -1}))
    finally:
        manager.plugins.pop("hf_lsce.integrations.axolotl.LscePlugin", None)
    with pytest.raises(ValueError, match="^adapter: qlora loads the base model through bitsandbytes|^adapter: qlora "
                                         "needs a CUDA GPU"):
        plugin.check_quantization(DictDefault(adapter="qlora", load_in_4bit=True))
    p = plugin.LscePlugin()
    cfg = DictDefault(model_config_type="llama", val_set_size=0.1, **keys)
    p.pre_model_load(cfg)
    trainer = Trainer(model=tiny_model("llama"), args=TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                                                        use_cpu=True))
    (cb,) = p.add_callbacks_post_trainer(cfg, trainer)
    assert cb.trainer is trainer and [(t.name, len(t)) for t in cb.tasks] == [("arc_easy", 5)]
    assert p.add_callbacks_post_trainer(DictDefault(model_config_type="llama"), trainer) == []


def test_hf_lsce_llamafactory_command_refuses_in_one_line(monkeypatch, tmp_path, capsys):
    """The command line's route: a user error is one line on stderr and exit status 2, nothing run."""
    from hf_lsce.cli import main

    monkeypatch.setattr(versions, "installed_version", lambda name: None if name == "llamafactory" else "99")
    assert main(["llamafactory", "train", str(tmp_path / "cfg.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-lsce llamafactory: LLaMA-Factory is not installed") and "\n" not in err
    assert main(["llamafactory", "evaluate", "cfg.yaml"]) == 2
    assert "only 'train CONFIG.yaml' is routed" in capsys.readouterr().err


def test_the_example_yamls_pass_their_frameworks_checks():
    """examples/axolotl and examples/llamafactory: their hf_lsce keys (smoothing, calibration with an evaluation to run
    at) pass the plugin's config model and the route's check, as the frameworks would apply them."""
    import yaml

    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples"
    ax = yaml.safe_load((root / "axolotl" / "lsce_llama_lora.yml").read_text())
    keys = LsceArgs.model_validate(ax)
    assert keys.lsce_calibration_tasks == "arc_easy,mmlu" and keys.lsce_calibration_limit == 200
    assert keys.label_smoothing_factor == 0.1  # (Axolotl's own config drops the key; the plugin's keeps it)
    qlora = yaml.safe_load((root / "axolotl" / "lsce_gemma3_qlora.yml").read_text())
    LsceArgs.model_validate(qlora)
    assert qlora["adapter"] == "qlora" and qlora["load_in_4bit"] is True and qlora["label_smoothing_factor"] == 0.1
    assert "hf_lsce.integrations.axolotl.LscePlugin" in qlora["plugins"]
    for name, key in (("lsce_llama3_8b_fsdp2.yml", "fsdp_version"), ("lsce_llama3_8b_zero3.yml", "deepspeed")):
        several = yaml.safe_load((root / "axolotl" / name).read_text())
        assert LsceArgs.model_validate(several).label_smoothing_factor == 0.1 and several[key]
    assert (root.parent / yaml.safe_load((root / "axolotl" / "lsce_llama3_8b_zero3.yml").read_text())["deepspeed"]).is_file()
    lf = yaml.safe_load((root / "llamafactory" / "lsce_llama_lora_sft.yaml").read_text())
    check_config(lf, "llama")
    assert lf["lsce_calibration_tasks"] == "arc_easy,mmlu"
    lf_qlora = yaml.safe_load((root / "llamafactory" / "lsce_gemma3_qlora_sft.yaml").read_text())
    problem = versions.quantization_problem("quantization_bit: 4")
    if problem is not None:  # (no bitsandbytes, or no GPU: refused first, with that line)
        import re

        assert problem.startswith("quantization_bit: 4 ")
        with pytest.raises(ValueError, match=f"^{re.escape(problem)}$"):
            check_config(lf_qlora, "gemma3_text")
        lf_qlora = {k: v for k, v in lf_qlora.items() if k != "quantization_bit"}
    check_config(lf_qlora, "gemma3_text")
    assert lf_qlora["label_smoothing_factor"] == 0.1
    lf_zero3 = yaml.safe_load((root / "llamafactory" / "lsce_llama3_8b_zero3.yaml").read_text())
    check_config(lf_zero3, "llama")
    assert (root.parent / lf_zero3["deepspeed"]).is_file() and lf_zero3["finetuning_type"] == "full"
