"""Test-wide settings: one thread (tiny ops are 40-70x slower with two here), no Hub, no leaked accelerate state."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
# the research code beside the recipes imports as `research`, as it does for a script run from recipes/
sys.path.append(str(REPO / "recipes"))


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


class RecipeScripts:
    """The scripts in recipes/, imported as modules (to call ``main(argv)`` in-process) or run as users run them."""

    directory = REPO / "recipes"

    def load(self, name: str) -> ModuleType:
        """``recipes/<name>.py`` as a module, imported once; its research code
        (recipes/research) imports as ``research``, from recipes/ on the path as for a script run by users."""
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, self.directory / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclass fields and HfArgumentParser resolve their annotations through it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module

    @staticmethod
    def environment(tmp_path: Path) -> dict[str, str]:
        """A script's environment: this checkout on the path, one thread, offline, caches under ``tmp_path``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
        env.update(
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
            HF_HOME=str(tmp_path / "hf_home"),
            HF_FLATBIAS_CACHE=str(tmp_path / "cache"),
        )
        return env

    def run(self, script: str, *args: str, tmp_path: Path, timeout: int = 600) -> subprocess.CompletedProcess:
        """Run ``python recipes/<script> args...`` in a fresh process from ``tmp_path``, capturing its output."""
        return subprocess.run(
            [sys.executable, str(self.directory / script), *args],
            env=self.environment(tmp_path),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="session")
def recipes() -> RecipeScripts:
    """Load or run the scripts in recipes/ (see `RecipeScripts`)."""
    return RecipeScripts()
