"""Test-wide settings: one thread (tiny ops are 40-70x slower with two here), no Hub, no leaked accelerate state."""

import functools
import importlib.util
import os
import re
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
# the research code beside the recipes imports as `research`, as it does for a script run from recipes/: pytest's
# `pythonpath` setting in pyproject.toml puts recipes/ on the path

# `pytest -m smoke`: one quick, representative check per area for daily work (the README says how long it takes); the
# default run (`pytest`) still runs everything not marked slow. tests/test_project_layout.py checks each name exists.
SMOKE = (
    "test_trainer_sam.py::test_trainer_matches_reference_sam[sam-micro_batch-1-0.05]",
    "test_sam_variants.py::test_functional_sam_restores_the_weights_bit_for_bit",
    "test_regularizers.py::test_penalty_step_matches_reference[fisher_penalty-classification-1]",
    "test_flatness_methods.py::test_the_method_table_names_the_methods_the_config_and_cards_know",
    "test_flatness_estimators.py::test_exact_fisher_matches_a_jacobian_reference",
    "test_flatness_estimators.py::test_fisher_estimators_are_within_four_standard_errors_of_the_exact_trace[per_sample]",
    "test_flatness_contexts.py::test_masked_lm_contexts_mask_one_ordinary_token_and_label_it",
    "test_flatness_spectrum.py::test_measuring_leaves_the_model_as_it_was",
    "test_flatness_spectrum.py::test_sam_sharpness_equals_a_direct_computation[False]",
    "test_flatness_hutchpp.py::test_a_matrix_of_rank_at_most_the_sketch_is_traced_exactly",
    "test_flatness_diagonal.py::test_summaries_add_up_and_bad_estimators_are_refused",
    "test_critical_sharpness.py::test_gradient_descent_on_a_quadratic_gives_the_rayleigh_quotient_of_the_gradient[0-0.02]",
    "test_robustness.py::test_each_draw_is_the_quadratic_form_of_its_noise[absolute]",
    "test_robustness.py::test_quantized_matrices_are_the_linear_and_embedding_weights",
    "test_trace_callback.py::test_logged_values_reach_log_history_and_reporters_without_changing_training",
    "test_modelcard.py::test_card_reads_back_as_the_same_typed_object",
    "test_spectrum_measures.py::test_card_records_every_measure_and_reads_it_back",
    "test_cli_parser.py::test_every_flag_is_kebab_case",
    "test_cli_parser.py::test_help_and_every_command_help_import_neither_torch_nor_transformers",
    "test_cli_trace.py::test_trace_command_prints_and_writes_the_library_estimate",
    "test_cli_errors.py::test_what_looks_like_a_local_path[./ckpt-True]",
    "test_glue.py::test_every_task_metric_matches_sklearn_scipy_offline[sst2]",
    "test_synthetic_pcfg.py::test_masked_conditionals_match_enumeration_and_sum_to_one",
    "test_synthetic_hmm.py::test_conditionals_match_enumeration",
    "test_synthetic_dyck.py::test_membership_depth_and_conditionals",
    "test_probe.py::test_linearly_separable_features_are_found",
    "test_selection.py::test_flattest_within_absolute_tolerance",
    "test_enlarge.py::test_bert_mlm_logits_unchanged[dtype0-same]",
    "test_adversarial.py::test_confusion_loss_is_cross_entropy_to_uniform",
    "test_muon.py::test_adamw_for_sends_chosen_matrices_to_adamw",
    "test_trl.py::test_sft_sam_matches_plain_pytorch_sam[completion_only-micro_batch-1]",
    "test_checkpoints.py::test_intact_checkpoints_pass",
    "test_hub.py::test_card_pushed_with_the_client_is_read_back_by_repo_id",
    "test_checkpoint_series.py::test_patterns_expand_over_the_refs_in_step_order",
    "test_demo.py::test_matched_loss_is_the_lowest_loss_both_runs_reached",
    "test_tutorial.py::test_the_tutorials_blocks_are_the_committed_run",
    "test_ruler_gate.py::test_gate_against_hand_computed_splits",
    "test_research_paper_protocol.py::test_t_interval_matches_scipy",
)
# `pytest -m research` / `-m "not research"`: the tests of the research campaign's code (recipes/research, imported as
# `research`), found by what a test module imports or which of the campaign's scripts in recipes/ it loads or runs
_IMPORTS_RESEARCH = re.compile(r"^\s*(from|import) research\b", re.M)


@functools.cache
def _research_scripts() -> tuple[str, ...]:
    return tuple(
        path.stem for path in sorted((REPO / "recipes").glob("*.py")) if _IMPORTS_RESEARCH.search(path.read_text())
    )


@functools.cache
def is_research_test(path: Path) -> bool:
    """Whether the test module at ``path`` imports the research code or loads or runs one of its scripts."""
    text = path.read_text()
    return bool(_IMPORTS_RESEARCH.search(text)) or any(
        re.search(rf"[\"']{name}(\.py)?[\"']", text) for name in _research_scripts()
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers
def pytest_collection_modifyitems(config, items):
    smoke = set(SMOKE)
    for item in items:
        path = Path(str(item.path))
        if not path.is_relative_to(REPO / "tests") or path.suffix != ".py":
            continue
        if path.relative_to(REPO / "tests").as_posix() + "::" + item.name in smoke:
            item.add_marker(pytest.mark.smoke)
        if is_research_test(path):
            item.add_marker(pytest.mark.research)


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
