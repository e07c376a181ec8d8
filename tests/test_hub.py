"""Push checkpoints with flatness cards to a Hub-compatible server on 127.0.0.1 and load them back.

The client is the unmodified huggingface_hub / transformers stack. Most tests aim the already-imported client at
the server (`point_hub_client_at`); `test_fresh_process_configured_by_environment_only` checks the way a user
configures it, with environment variables in a new process.
"""

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import HfApi, ModelCard, hf_hub_download, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError
from test_modelcard import FixedTraceCallback, full_card, tiny_args, tiny_mlm_setup
from transformers import BertForMaskedLM

from hf_flatbias.config import FLATNESS_METHOD_HYPERPARAMETERS, FLATNESS_METHODS
from hf_flatbias.modelcard import load_flatness_card
from hf_flatbias.synthetic.tokenizer import make_tokenizer
from hf_flatbias.trainer import FlatBiasTrainer
from tests.helpers.hub_server import HubServer, hub_client_environment, point_hub_client_at

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    with HubServer() as server:
        point_hub_client_at(server.url, monkeypatch, str(tmp_path / "hf_home"))
        yield server


def card_metadata(content: bytes) -> dict:
    return yaml.safe_load(content.decode().split("---\n")[1])


def test_server_answers_with_the_hub_status_codes(hub):
    api = HfApi()
    url = api.create_repo("user/codes")
    assert url.repo_id == "user/codes" and url.startswith(hub.url)

    with pytest.raises(HfHubHTTPError) as conflict:
        api.create_repo("user/codes")
    assert conflict.value.response.status_code == 409
    assert conflict.value.response.json()["url"] == f"{hub.url}/user/codes"
    assert api.create_repo("user/codes", exist_ok=True).repo_id == "user/codes"

    with pytest.raises(RemoteEntryNotFoundError) as missing:
        hf_hub_download("user/codes", "pytorch_model.bin")
    assert missing.value.response.status_code == 404
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("user/never-created")


def test_card_pushed_with_the_client_is_read_back_by_repo_id(hub, tmp_path):
    HfApi().create_repo("user/card-only")
    full_card(hessian_trace=77.0).save(tmp_path / "card")
    HfApi().upload_folder(repo_id="user/card-only", folder_path=tmp_path / "card", commit_message="card")

    card = load_flatness_card("user/card-only")
    assert (card.hessian_trace, card.hessian_trace_stderr, card.method) == (77.0, 4.5, "sam")
    assert card.glue["sst2"]["accuracy"] == 0.875


def test_push_trained_checkpoint_and_load_it_back_by_repo_id(hub, tmp_path):
    model, data = tiny_mlm_setup()
    output_dir = tmp_path / "run"
    # hub_always_push: without it the Trainer skips a checkpoint push while the previous one is still uploading.
    args = tiny_args(
        output_dir, push_to_hub=True, hub_model_id="user/tiny-sam", hub_strategy="checkpoint", hub_always_push=True
    )
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=data, callbacks=[FixedTraceCallback(12.5)])
    # Hold the step-2 push's first LFS request, as a slow Hub or a loaded machine does, so that training reaches the
    # step-4 push, which rewrites output_dir's weights and card, while the step-2 push has yet to send them.
    hub.delay_next("lfs_batch", 0.5)
    trainer.train()
    trainer.push_to_hub(license="mit")

    commits = {c.summary: c.sha for c in hub.commits("user/tiny-sam")}
    assert "End of training" in commits
    assert any(s.startswith("Training in progress, step 2") and s.endswith("checkpoint") for s in commits)
    files = hub.files("user/tiny-sam")
    for name in (
        "README.md",
        "config.json",
        "model.safetensors",
        "last-checkpoint/README.md",
        "last-checkpoint/model.safetensors",
        "last-checkpoint/trainer_state.json",
    ):
        assert name in files, name
    for name in ("README.md", "config.json", "model.safetensors"):
        assert files[name] == (output_dir / name).read_bytes(), name
    assert "Training in progress, step 2" in commits, "the step-2 push failed or was skipped"
    step_2 = hub.files("user/tiny-sam", commits["Training in progress, step 2"])
    assert card_metadata(step_2["README.md"])["flatness"]["global_step"] == 2
    assert step_2["model.safetensors"] == (output_dir / "checkpoint-2" / "model.safetensors").read_bytes()

    reloaded = BertForMaskedLM.from_pretrained("user/tiny-sam", cache_dir=str(tmp_path / "cache"))
    expected = trainer.model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    card = load_flatness_card("user/tiny-sam")
    assert (card.hessian_trace, card.hessian_trace_stderr, card.n_contexts, card.n_draws) == (12.5, 0.5, 8, 2)
    assert (card.method, card.sam_rho, card.license, card.global_step) == ("sam", 0.05, "mit", 4)
    last_loss = [e["loss"] for e in trainer.state.log_history if "loss" in e][-1]
    assert card.pretraining_loss == pytest.approx(last_loss)

    snapshot = Path(snapshot_download("user/tiny-sam", cache_dir=str(tmp_path / "cache")))
    assert load_flatness_card(snapshot / "last-checkpoint").global_step == 4


def test_server_failure_mid_push_raises_keeps_the_local_save_and_a_retry_succeeds(hub, tmp_path):
    model, data = tiny_mlm_setup()
    output_dir = tmp_path / "run"
    args = tiny_args(output_dir, push_to_hub=True, hub_model_id="user/flaky", save_strategy="no", max_steps=2)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=data, callbacks=[FixedTraceCallback(3.0)])
    trainer.train()
    commits_before = len(hub.commits("user/flaky"))

    hub.fail_next("commit")  # the weights reach LFS storage, then the commit itself fails
    with pytest.raises(HfHubHTTPError, match=r"(?s)500.*did not complete.*intact.*push_to_hub\(\) again"):
        trainer.push_to_hub()
    assert len(hub.commits("user/flaky")) == commits_before, "a failed push must not leave a partial commit"
    local = BertForMaskedLM.from_pretrained(str(output_dir))
    for name, tensor in local.state_dict().items():
        assert torch.equal(tensor, trainer.model.state_dict()[name]), name
    assert load_flatness_card(output_dir).hessian_trace == 3.0

    trainer.push_to_hub()
    files = hub.files("user/flaky")
    for name in ("README.md", "config.json", "model.safetensors"):
        assert files[name] == (output_dir / name).read_bytes(), name
    assert load_flatness_card("user/flaky").hessian_trace == 3.0


def test_unreachable_hub_at_the_final_push_names_what_is_intact_and_how_to_retry(hub, tmp_path):
    model, data = tiny_mlm_setup()
    output_dir = tmp_path / "run"
    args = tiny_args(output_dir, push_to_hub=True, hub_model_id="user/gone", save_strategy="no", max_steps=2)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=data, callbacks=[FixedTraceCallback(3.0)])
    trainer.train()
    hub.stop()
    with pytest.raises(ConnectionError, match=r"(?s)did not complete.*intact.*push_to_hub\(\) again"):
        trainer.save_model()
    assert load_flatness_card(output_dir).hessian_trace == 3.0
    assert os.path.isfile(output_dir / "model.safetensors")


def test_failed_background_checkpoint_push_is_reported(hub, tmp_path, caplog):
    model, data = tiny_mlm_setup()
    args = tiny_args(tmp_path / "run", push_to_hub=True, hub_model_id="user/bg", hub_strategy="checkpoint")
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=data, callbacks=[FixedTraceCallback(3.0)])
    hub.fail_next("commit")
    with caplog.at_level(logging.WARNING, logger="hf_flatbias.modelcard.publishing"):
        trainer.train()
        trainer.push_to_hub()
    assert any("Pushing checkpoint" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
    assert os.path.isfile(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    assert load_flatness_card("user/bg").global_step == 4


def test_pushing_a_non_finite_trace_is_refused_before_any_upload(hub, tmp_path):
    model, data = tiny_mlm_setup()
    output_dir = tmp_path / "run"
    args = tiny_args(output_dir, push_to_hub=True, hub_model_id="user/nan", hub_strategy="checkpoint", max_steps=2)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=data, callbacks=[FixedTraceCallback(float("nan"))])
    initial_commits = len(hub.commits("user/nan"))

    with pytest.raises(ValueError, match="hessian_trace=nan: the number is not finite"):
        trainer.train()  # the step-2 checkpoint push
    assert os.path.isfile(output_dir / "checkpoint-2" / "model.safetensors"), "the local checkpoint is kept"
    with pytest.raises(ValueError, match="hessian_trace=nan: the number is not finite"):
        trainer.push_to_hub()
    assert len(hub.commits("user/nan")) == initial_commits
    assert hub.state.calls["preupload"] == 0 and hub.state.calls["commit"] == 0


@pytest.mark.parametrize("method", FLATNESS_METHODS)
def test_every_method_saves_and_pushes_its_card(hub, tmp_path, method):
    model, data = tiny_mlm_setup()
    repo_id = f"user/tiny-{method.replace('_', '-')}"
    args = tiny_args(tmp_path / "run", flatness_method=method, max_steps=2, push_to_hub=True, hub_model_id=repo_id)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=data, callbacks=[FixedTraceCallback(6.5)])
    trainer.train()
    trainer.push_to_hub()

    local = load_flatness_card(tmp_path / "run" / "checkpoint-2")
    pushed = load_flatness_card(repo_id)
    for card in (local, pushed):
        assert (card.method, card.hessian_trace, card.global_step) == (method, 6.5, 2)
        assert card.method_hyperparameters() == {
            name: getattr(args, name) for name in FLATNESS_METHOD_HYPERPARAMETERS[method]
        }
    assert hub.files(repo_id)["README.md"] == (tmp_path / "run" / "README.md").read_bytes()


def hub_guide_python_block() -> str:
    """The first ```python block of the Hub guide, which continues the README's Quick start."""
    guide = (REPO_ROOT / "docs" / "guides" / "hub.md").read_text(encoding="utf-8")
    return guide.split("```python\n", 1)[1].split("\n```", 1)[0]


def test_hub_guide_example_publishes_the_trace_of_the_pushed_weights(hub, tmp_path, monkeypatch, capsys):
    model, data = tiny_mlm_setup()
    words = [f"w{i}" for i in range(model.config.vocab_size - 5)]  # ids 5.. are words, as in tiny_mlm_setup's data
    namespace = {
        "model": model,
        "train": data,
        "valid": data,  # labelled rows: evaluate() gives the held-out loss the card records
        "collator": None,
        "tokenizer": make_tokenizer(words),
    }
    monkeypatch.chdir(tmp_path)
    exec(compile(hub_guide_python_block(), "docs/guides/hub.md", "exec"), namespace)

    trainer = namespace["trainer"]
    final_step = trainer.state.global_step
    assert final_step == trainer.args.max_steps > 0
    # the card exactly as the Hub serves it, parsed with huggingface_hub's own ModelCard
    card = ModelCard(hub.files("me/bert-sam")["README.md"].decode())
    flatness = card.data.flatness
    assert math.isfinite(flatness["hessian_trace"]) and flatness["hessian_trace"] > 0
    assert flatness["trace_step"] == flatness["global_step"] == final_step
    measured_at = [e["step"] for e in trainer.state.log_history if "flatness/hessian_trace" in e]
    assert measured_at == [final_step], "the final evaluation sees the weights measured at the end: no second one"
    eval_loss = next(e["eval_loss"] for e in reversed(trainer.state.log_history) if "eval_loss" in e)
    assert flatness["pretraining_loss"] == pytest.approx(eval_loss) and flatness["pretraining_loss_source"] == "eval"
    printed = capsys.readouterr().out
    assert f"at step {final_step}" in printed and f"loss {eval_loss:.3f} (eval)" in printed


PUSH_CARDS_SCRIPT = """
import sys
from huggingface_hub import HfApi

api = HfApi()
for name in sys.argv[2:]:
    api.create_repo(f"user/{name}")
    api.upload_folder(repo_id=f"user/{name}", folder_path=f"{sys.argv[1]}/{name}", commit_message="card")
"""


def run_with_hub_environment(command, server, tmp_path):
    env = {**os.environ, **hub_client_environment(server.url, str(tmp_path / "fresh_hf_home"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_fresh_client_configured_by_environment_only_pushes_cards(hub, tmp_path):
    """What a user does: HF_ENDPOINT and HF_HUB_DISABLE_XET set before huggingface_hub is imported, nothing patched."""
    full_card(hessian_trace=5.0).save(tmp_path / "a")
    pushed = run_with_hub_environment([sys.executable, "-c", PUSH_CARDS_SCRIPT, str(tmp_path), "a"], hub, tmp_path)
    assert pushed.returncode == 0, pushed.stderr
    assert hub.files("user/a")["README.md"] == (tmp_path / "a" / "README.md").read_bytes()
    assert load_flatness_card("user/a").hessian_trace == 5.0


@pytest.mark.slow
def test_cli_compares_hub_repos_in_a_fresh_process(tmp_path):
    full_card(hessian_trace=5.0).save(tmp_path / "a")
    full_card(hessian_trace=50.0, method="none", sam_rho=None).save(tmp_path / "b")
    with HubServer() as server:
        pushed = run_with_hub_environment(
            [sys.executable, "-c", PUSH_CARDS_SCRIPT, str(tmp_path), "a", "b"], server, tmp_path
        )
        assert pushed.returncode == 0, pushed.stderr
        compare = run_with_hub_environment(
            [sys.executable, "-m", "hf_flatbias.cli", "compare", "user/b", "user/a", "--sort", "trace"],
            server,
            tmp_path,
        )
    assert compare.returncode == 0, compare.stderr
    rows = compare.stdout.strip().splitlines()
    assert rows[2].startswith("| user/a |") and "5 ± 4.5" in rows[2]
    assert rows[3].startswith("| user/b |") and "50 ± 4.5" in rows[3]


@pytest.mark.slow  # about 1-2 minutes: two processes each import transformers and train
@pytest.mark.distributed
def test_only_rank_zero_writes_and_pushes_cards_with_two_processes(hub, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(hub_client_environment(hub.url, str(tmp_path / "fresh_hf_home")))
    env.update(PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{REPO_ROOT / 'tests'}", OMP_NUM_THREADS="1")
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        str(REPO_ROOT / "tests" / "helpers" / "hub_distributed_script.py"),
        str(tmp_path / "run"),
        "user/ddp",
    ]
    launched = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert launched.returncode == 0, launched.stderr[-4000:]
    assert (tmp_path / "done.rank0").read_text() == "2" and (tmp_path / "done.rank1").exists()

    assert not (tmp_path / "card_writes.rank1.txt").exists(), "rank 1 rendered a card"
    assert (tmp_path / "card_writes.rank0.txt").read_text().split().count("4") >= 1
    card = load_flatness_card("user/ddp")
    assert (card.hessian_trace, card.global_step) == (7.0, 4)
    # Rank 0 alone: one create_repo; one upload each for output_dir and the checkpoint at steps 2 and 4, one final.
    assert hub.state.calls["create_repo"] == 1
    assert hub.state.calls["preupload"] == 5
