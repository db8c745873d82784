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
        assert float(ns["loss"].detach()) == pytest.approx(float(ref), rel=1e-4)


# ----------------------------------------------------------------------------------------- links and paths
LINK_PAGES = PAGES + [ROOT / "benchmarks" / "README.md", ROOT / "examples" / "README.md", ROOT / "CHANGELOG.md"]
# a path written in backticks: a repository folder, then more (the shared data beside the clone is not ours)
PATH_RE = re.compile(r"`((?:benchmarks|docs|examples|hf_lsce|tests|tools)/[^`\s*{}]+)`")


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped (hyphens and underscores kept),
    spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


@pytest.mark.parametrize("page", LINK_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_in_the_docs_resolves(page):
    """Markdown links to files (and their #anchors) and backticked repository paths exist: a page that cites a
    result file, a script or a section that is gone fails here."""
    text = page.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            missing.append(f"{target} (no such heading)")
    for rel in PATH_RE.findall(text):
        rel = rel.split("::")[0].rstrip(".,;:)")  # a test named by its pytest id: its file
        if not any((base / rel).exists() for base in (ROOT, page.parent)):
            missing.append(rel)
    assert not missing, f"{page.relative_to(ROOT)} points to what does not exist: {missing}"


# ----------------------------------------------------------------------------------------- the house
def test_the_house_stays_readable():
    """What a newcomer meets first stays small: the README's front page at most 700 words, benchmarks/ (what a user
    runs to compare) at most 2,500 lines of Python."""
    assert len((ROOT / "README.md").read_text().split()) <= 700
    assert sum(len(p.read_text().splitlines()) for p in (ROOT / "benchmarks").rglob("*.py")) <= 2500


def test_no_import_circle_in_the_package():
    """No two modules of hf_lsce import each other, directly or through others (read with ast, nothing run): a
    module that two commands share is imported by both."""
    import ast

    pkg = ROOT / "hf_lsce"
    mods = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in pkg.rglob("*.py")}
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        base = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                stem = ".".join(base.split(".")[: len(base.split(".")) - node.level + 1] + [node.module or ""]) \
                    if node.level else (node.module or "")
                names = [stem.rstrip(".")] + [f"{stem.rstrip('.')}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            edges[m] |= {n for n in names if n in mods and n != m and mods[n].name != "__init__.py"}
    state = {}

    def visit(m, path):  # depth-first; a module met again on the current path closes a circle
        state[m] = "open"
        for n in edges[m]:
            if state.get(n) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"
    for m in mods:
        if m not in state:
            visit(m, [m])
