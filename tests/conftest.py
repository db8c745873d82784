"""Test configuration: CPU only; Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton decorates the kernels, hence before hf_lsce is imported.
"""
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture
def shared_data():
    """The real evaluation data beside the checkout (../shared/data); skip if absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (expected beside the checkout)")
    return str(SHARED_DATA)


@pytest.fixture(scope="module")
def shared_data_module():
    """``shared_data`` for module-scoped fixtures."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (expected beside the checkout)")
    return str(SHARED_DATA)
