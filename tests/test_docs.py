"""Every ```python snippet in the README and docs/ runs, page by page, top to bottom.

Snippets name real models ("meta-llama/Llama-3.2-1B") and data ("../shared/data"). Nothing here
reaches the hub, so the test runs them in a scratch folder where that model name is a local folder
holding a tiny random Llama with a tokenizer (from_pretrained reads a local folder first), and
"../shared/data" is the real data. The variables the prose says the reader already has (``model``,
``tokenizer``, ``hidden``, ``labels``, ``ds``, ``args``, ``train``, ``held_out``, ``input_ids``,
``mask``) are provided small and real. The snippets' own code runs unchanged.
"""
import json
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HUB_NAME = "meta-llama/Llama-3.2-1B"


def snippets(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, shared_data_module):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_lsce.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("docs")
    (root / "shared").symlink_to(shared_data_module.rsplit(os.sep, 1)[0])
    work = root / "work"
    work.mkdir()
    records = json.loads(Path(shared_data_module, "alpaca", "alpaca_en_demo.json").read_text())
    texts = [r["instruction"] + " " + r.get("input", "") + " " + r["output"] for r in records]
    texts += ["Answer: A", "Answer: B", "Answer: C", "Answer: D"] * 50
    tok = train_bpe_tokenizer(texts, vocab_size=512, model_max_length=4096)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(work / HUB_NAME)
    tok.save_pretrained(work / HUB_NAME)
    return work


def reader_namespace(work: Path) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(work / HUB_NAME)
    model = AutoModelForCausalLM.from_pretrained(work / HUB_NAME)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tokenizer), (8, 16), generator=g)
    pc = [{"prompt": f"Question {i}: what is {i} plus {i}?\nAnswer:", "completion": f" {2 * i}"} for i in range(16)]
    return dict(
        model=model, tokenizer=tokenizer, SFTTrainer=SFTTrainer,
        hidden=torch.randn(2, 16, model.config.hidden_size, generator=g, requires_grad=True),
        labels=torch.randint(0, model.config.vocab_size, (2, 16), generator=g),
        input_ids=ids, mask=torch.ones_like(ids),
        ds=Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()}),
        train=Dataset.from_list(pc[:12]), held_out=Dataset.from_list(pc[12:]),
        args=SFTConfig(output_dir=str(work / "sft"), max_steps=2, eval_strategy="steps", eval_steps=2,
                       per_device_train_batch_size=4, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                       max_length=64, disable_tqdm=True),
    )


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    from hf_lsce import revert_lsce_patch

    revert_lsce_patch()  # a snippet may patch every class


@pytest.mark.parametrize("page", [p for p in PAGES if snippets(p)], ids=lambda p: p.name)
def test_page_snippets_run(page, scratch, monkeypatch):
    monkeypatch.chdir(scratch)
    ns = reader_namespace(scratch)
    for i, code in enumerate(snippets(page)):
        try:
            exec(compile(code, f"{page.name}[snippet {i}]", "exec"), ns)
        except Exception as e:  # name the snippet that failed
            raise AssertionError(f"{page.relative_to(ROOT)} snippet {i} failed:\n{code}") from e
    if page.name == "README.md":  # the first snippet's loss is HF's causal-LM loss with smoothing 0.1
        import torch.nn.functional as F

        logits = (ns["hidden"].detach().double() @ ns["model"].lm_head.weight.detach().double().T)[:, :-1]
        ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ns["labels"][:, 1:].reshape(-1),
                              label_smoothing=0.1)
        assert float(ns["loss"]) == pytest.approx(float(ref), rel=1e-4)
