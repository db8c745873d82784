"""The oldest transformers and TRL the patch is tested with, and the check that refuses older ones.

The floors are the oldest versions ``tools/version_matrix.py`` runs the patch and training tests on (transformers
4.57.1 with TRL 0.24.0); LLaMA-Factory 0.9.5 pins transformers 5.6.0 and TRL 0.24.0, Axolotl 0.19.0 transformers
5.16.1 and TRL 1.9.0, and CI the newest. Below a floor the Trainer's and TRL's loss plumbing differs in ways the patch
was not checked against, so ``apply_lsce_patch`` fails closed with one line naming the version found and the one needed.
"""
from __future__ import annotations

import functools
import os
from importlib import metadata

from packaging.version import Version

MIN_VERSIONS = {"transformers": "4.57.1", "trl": "0.24.0"}


def installed_version(name: str) -> str | None:
    """The installed distribution's version, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def version_problem(name: str, found: str | None, floor: str | None = None) -> str | None:
    """One line saying why ``found`` (a version of ``name``, None: not installed) cannot be used, or None; ``floor``:
    the oldest version tested (default: ``MIN_VERSIONS``'s)."""
    floor = floor or MIN_VERSIONS[name]
    if found is None:
        if name == "trl":
            return None
        return f"hf_lsce needs {name} >= {floor}, which is not installed: pip install '{name}>={floor}'"
    if Version(found) < Version(floor):
        return (f"hf_lsce needs {name} >= {floor} (the oldest it is tested with), found {found}: "
                f"pip install -U '{name}>={floor}'")
    return None


def untested_ceiling(found: str, newest: str) -> str | None:
    """The release to stay below (``"0.9"``) where ``found`` is a newer minor release than ``newest``, the newest run
    with, and ``HF_LSCE_UNTESTED_FRAMEWORK=1`` does not ask to try it; else None."""
    if Version(found).release[:2] <= Version(newest).release[:2] or os.environ.get("HF_LSCE_UNTESTED_FRAMEWORK") == "1":
        return None
    major, minor = Version(newest).release[:2]
    return f"{major}.{minor + 1}"


def environment_problem(framework: str | None = None, floor: str | None = None,
                        newest: str | None = None) -> str | None:
    """The first version problem (one line) of ``framework`` (an integration's, at least ``floor``, and no newer
    minor release than ``newest``, the newest it was run with, unless ``HF_LSCE_UNTESTED_FRAMEWORK=1``; when
    installed), transformers and TRL, or None: what the integrations refuse a launch with before anything loads."""
    found = installed_version(framework) if framework is not None else None
    if found is not None:
        problem = version_problem(framework, found, floor)
        if problem is not None:
            return problem
        ceiling = untested_ceiling(found, newest) if newest is not None else None
        if ceiling is not None:
            return (f"hf_lsce's {framework} integration is tested with {framework} {floor} to {newest}, found {found}: "
                    f"pip install '{framework}<{ceiling}', or set HF_LSCE_UNTESTED_FRAMEWORK=1 to try it untested")
    return next((p for name in MIN_VERSIONS if (p := version_problem(name, installed_version(name))) is not None),
                None)


def quantization_problem(key: str) -> str | None:
    """One line saying why a 4- or 8-bit base (QLoRA: bitsandbytes' layers on a CUDA GPU) cannot load here, naming the
    config's ``key``, or None."""
    import importlib.util

    import torch

    if importlib.util.find_spec("bitsandbytes") is None:
        return f"{key} loads the base model through bitsandbytes, which is not installed: pip install bitsandbytes"
    if not torch.cuda.is_available():
        why = "torch is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
        return f"{key} needs a CUDA GPU for bitsandbytes' 4- and 8-bit layers, and {why}: train without it (LoRA)"
    return None


@functools.lru_cache(maxsize=None)
def _problems() -> tuple[str, ...]:
    problem = environment_problem()
    return () if problem is None else (problem,)


def check_versions() -> None:
    """Raise ImportError (one line) when transformers or an installed TRL is older than the floors (TRL is optional)."""
    problems = _problems()
    if problems:
        raise ImportError(problems[0])
