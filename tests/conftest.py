"""Test configuration: CPU only; Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton decorates the kernels, hence before hf_lsce is imported.
"""
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist each worker gets its share of the cores: 2 workers x 2 torch threads on 2 cores
# oversubscribe them, and matmul-heavy tests (real checkpoints) ran 5-10 x slower than alone. Subprocesses
# that tests start inherit the setting.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, _THREADS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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



@pytest.fixture(autouse=True)
def _restore_environment():
    """transformers before 5.x (4.57, 5.6: LLaMA-Factory's pins) exports ACCELERATE_MIXED_PRECISION=bf16 from a bf16
    Trainer's arguments and leaves it set: every later Trainer of the process then trained in bf16, an fp32 test
    included. Each test starts from the environment the session started with."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)
