"""Test-wide settings: one thread (tiny ops are 40-70x slower with two here), no Hub, no leaked accelerate state."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _isolated_hf_home(tmp_path_factory):
    """evaluate and datasets write caches under HF_HOME even for local modules: keep them out of ~/.cache."""
    home = tmp_path_factory.mktemp("hf_home")
    previous = os.environ.get("HF_HOME")
    os.environ["HF_HOME"] = str(home)
    yield home
    if previous is None:
        os.environ.pop("HF_HOME", None)
    else:
        os.environ["HF_HOME"] = previous


@pytest.fixture(autouse=True)
def _clear_accelerate_env():
    """accelerate leaves ACCELERATE_USE_DEEPSPEED and friends in os.environ: later runs would silently use them."""
    before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    yield
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        del os.environ[key]
    os.environ.update(before)
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
