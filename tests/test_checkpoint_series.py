"""Following a series of published checkpoints: ``hf-flatbias trace REPO --revisions ...`` against the local
Hub-compatible server, with a repo of four revisions (branches step20, step100, step300 and a tag): one row per
revision on the same contexts, a rerun that skips rows already written, glob patterns over the refs, the plot, and
cards read at a revision (``REPO@REV``, ``--revision``)."""

import json

import pytest
import torch
from huggingface_hub import HfApi
from transformers import BertForMaskedLM

from hf_flatbias.cli import main
from hf_flatbias.commands import trace as trace_command
from hf_flatbias.commands.trace_series import parse_step, read_rows, resolve_revisions
from hf_flatbias.flatness import build_masked_contexts, estimate_hessian_trace
from hf_flatbias.modelcard import load_flatness_card
from hf_flatbias.synthetic import make_tokenizer
from tests.helpers.hub_server import HubServer, point_hub_client_at
from tests.helpers.tiny_models import small_bert_config
from tests.test_modelcard import full_card

WORDS = [f"w{i}" for i in range(10)]
REPO = "user/series"
STEPS = (20, 100, 300)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three checkpoints of one architecture (different weights), each with its tokenizer and a card whose trace
    says which it is, plus the text they are measured on."""
    root = tmp_path_factory.mktemp("series")
    tokenizer = make_tokenizer(WORDS, model_max_length=32)
    config = small_bert_config(len(tokenizer), max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id)
    folders = []
    for step in STEPS:
        folder = root / f"step{step}"
        torch.manual_seed(step)
        BertForMaskedLM(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        full_card(hessian_trace=float(step), trace_step=step, global_step=step).save(folder)
        folders.append(folder)
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, 10, (7,), generator=generator)) for _ in range(8)]
    data = root / "text.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return folders, data, tokenizer, lines


@pytest.fixture
def hub(tmp_path, monkeypatch, checkpoints):
    """The server with REPO: one commit per checkpoint on main, a branch per step at its commit, tag v1 at the
    second."""
    folders = checkpoints[0]
    with HubServer() as server:
        point_hub_client_at(server.url, monkeypatch, str(tmp_path / "hf_home"))
        api = HfApi()
        api.create_repo(REPO)
        for step, folder in zip(STEPS, folders, strict=True):
            commit = api.upload_folder(repo_id=REPO, folder_path=folder, commit_message=f"step {step}")
            api.create_branch(REPO, branch=f"step{step}", revision=commit.oid)
        api.create_tag(REPO, tag="v1", revision="step100")
        yield server


def _trace_args(data, output, *extra):
    return ["trace", REPO, "--data", str(data), "--n-contexts", "6", "--n-draws", "2", "--seed", "3",
            "--output", str(output), "--no-progress", *extra]  # fmt: skip


def _library_trace(folder, tokenizer, lines):
    encoded = tokenizer(lines[:6], truncation=True, max_length=128)
    rows = [
        {"input_ids": i, "attention_mask": m}
        for i, m in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
    ]
    contexts = build_masked_contexts(
        rows, mask_token_id=tokenizer.mask_token_id, n_contexts=6, seed=3, special_token_ids=tokenizer.all_special_ids
    )
    return estimate_hessian_trace(BertForMaskedLM.from_pretrained(folder), contexts, n_draws=2, seed=3).mean


def test_the_server_keeps_branches_tags_and_their_files(hub, checkpoints):
    refs = HfApi().list_repo_refs(REPO)
    assert {ref.name for ref in refs.branches} == {"main", "step20", "step100", "step300"}
    assert [ref.name for ref in refs.tags] == ["v1"]
    tagged = next(ref for ref in refs.branches if ref.name == "step100").target_commit
    assert refs.tags[0].target_commit == tagged
    assert HfApi().model_info(REPO, revision="step20").sha != HfApi().model_info(REPO).sha
    assert hub.files(REPO, "step300") == hub.files(REPO, "main")


def test_patterns_expand_over_the_refs_in_step_order():
    class Ref:
        def __init__(self, name):
            self.name = name

    class Refs:
        branches = [Ref("main"), Ref("step300"), Ref("step20"), Ref("step100")]
        tags = [Ref("v1")]

    def refs(repo_id):
        return Refs

    assert resolve_revisions(REPO, "step*", list_refs=refs) == ["step20", "step100", "step300"]  # 20 < 100 by step
    assert resolve_revisions(REPO, "v1,step3*,abc123", list_refs=refs) == ["v1", "step300", "abc123"]
    assert resolve_revisions(REPO, "step1*,step100", list_refs=refs) == ["step100"]  # once
    assert resolve_revisions(REPO, "[mv]*", list_refs=refs) == ["main", "v1"]  # no steps: by name
    with pytest.raises(ValueError, match="matches none of the branches and tags of user/series .*step20"):
        resolve_revisions(REPO, "ckpt*", list_refs=refs)
    with pytest.raises(ValueError, match="empty"):
        resolve_revisions(REPO, " , ", list_refs=refs)
    assert [parse_step(name) for name in ("step1000", "step-20", "global_step_7", "v1", "main")] == [
        1000, 20, 7, None, None
    ]  # fmt: skip


def test_revisions_are_measured_on_the_same_contexts_and_a_rerun_skips_rows_written(
    hub, checkpoints, tmp_path, monkeypatch, capsys
):
    folders, data, tokenizer, lines = checkpoints
    output = tmp_path / "out" / "series.jsonl"

    # the run is interrupted while measuring its second revision: the first row is in the file, whole
    real_measure, calls = trace_command.measure, []

    def interrupted(args):
        calls.append(args.revision)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_measure(args)

    monkeypatch.setattr(trace_command, "measure", interrupted)
    assert main(_trace_args(data, output, "--revisions", "step20,step100", "--measures", "trace,weight_noise")) != 0
    assert "interrupted" in capsys.readouterr().err
    rows = read_rows(output)
    assert [row["revision"] for row in rows] == ["step20"]
    first = rows[0]
    monkeypatch.setattr(trace_command, "measure", real_measure)

    # the rerun, now over a pattern, measures only what is missing, in step order, and plots the series
    plot = tmp_path / "series.png"
    arguments = _trace_args(data, output, "--revisions", "step*", "--measures", "trace,weight_noise")
    assert main([*arguments, "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert "Already in" in printed and "skipped: step20" in printed
    rows = read_rows(output)
    assert [row["revision"] for row in rows] == ["step20", "step100", "step300"]
    assert [row["step"] for row in rows] == list(STEPS)
    assert rows[0] == first  # not measured again (its seconds would differ)
    assert len({row["contexts_sha256"] for row in rows}) == 1  # the same contexts for every revision
    assert len({row["commit"] for row in rows}) == 3
    for row, folder in zip(rows, folders, strict=True):
        assert row["estimate"]["mean"] == pytest.approx(_library_trace(folder, tokenizer, lines), rel=1e-6)
        assert row["measures"]["weight_noise"]["stderr"] >= 0 and row["settings"]["noise_sigmas"] == [0.01]
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"

    # everything written: nothing is measured again
    monkeypatch.setattr(trace_command, "measure", lambda args: pytest.fail("measured again"))
    assert main(arguments) == 0
    assert read_rows(output) == rows

    # rows of other settings are not mixed into the file
    assert main(_trace_args(data, output, "--revisions", "step*", "--measures", "trace")) == 2
    assert "other settings" in capsys.readouterr().err


def test_one_revision_and_bad_revision_flags(hub, checkpoints, tmp_path, capsys):
    folders, data, tokenizer, lines = checkpoints
    output = tmp_path / "one.json"
    assert main(_trace_args(data, output, "--revision", "v1")) == 0
    written = json.loads(output.read_text())
    assert written["revision"] == "v1" and f"Tr(F) of {REPO}@v1: " in capsys.readouterr().out
    assert written["estimate"]["mean"] == pytest.approx(_library_trace(folders[1], tokenizer, lines), rel=1e-6)

    assert main(_trace_args(data, output, "--revision", "step20", "--revisions", "step100")) == 2
    assert "--revision and --revisions" in capsys.readouterr().err
    local = ["trace", str(folders[0]), "--data", str(data), "--no-progress"]
    assert main([*local, "--revisions", "step100", "--output", str(tmp_path / "x.jsonl")]) == 2
    assert "needs a Hub repository" in capsys.readouterr().err
    assert main([*local, "--revision", "step100", "--output", str(tmp_path / "x.json")]) == 2
    assert "local folder" in capsys.readouterr().err
    assert main(_trace_args(data, tmp_path / "y.jsonl", "--revisions", "nothing*")) == 2
    assert "matches none" in capsys.readouterr().err


def test_cards_are_read_at_a_revision(hub, capsys):
    assert load_flatness_card(f"{REPO}@step20").hessian_trace == 20.0
    assert load_flatness_card(REPO, revision="v1").hessian_trace == 100.0
    assert load_flatness_card(REPO).hessian_trace == 300.0  # main
    with pytest.raises(ValueError, match="two revisions"):
        load_flatness_card(f"{REPO}@step20", revision="step100")

    assert main(["card", f"{REPO}@step100"]) == 0
    assert "| trace measured at step | 100 |" in capsys.readouterr().out
    assert main(["card", REPO, "--revision", "step20"]) == 0
    assert "| trace measured at step | 20 |" in capsys.readouterr().out

    assert main(["compare", f"{REPO}@step20", f"{REPO}@step100", REPO, "--revision", "step300"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith(f"| {REPO}@step20 | 2.5 | 20 ± 4.5 |")
    assert table[3].startswith(f"| {REPO}@step100 | 2.5 | 100 ± 4.5 |")
    assert table[4].startswith(f"| {REPO} | 2.5 | 300 ± 4.5 |")


# ---------------------------------------------------------------- issue 58: nothing written is lost, offline series


def _measure_must_not_run(monkeypatch):
    monkeypatch.setattr(trace_command, "measure", lambda args: pytest.fail(f"measured {args.revision}"))


def test_an_output_of_foreign_lines_is_refused_and_kept(checkpoints, tmp_path, monkeypatch, capsys):
    data = checkpoints[1]
    _measure_must_not_run(monkeypatch)
    for content in ('{"note": "mine"}\n{"note": "also mine"}\n', "plain words\n", '[1, 2]\n{"revision": "x"}\n'):
        notes = tmp_path / "notes.jsonl"
        notes.write_text(content)
        assert main(_trace_args(data, notes, "--revisions", "step20")) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and "not hf-flatbias series rows" in error and "another --output" in error
        assert notes.read_text() == content


def test_only_a_half_written_last_row_of_a_series_is_dropped(tmp_path, capsys):
    row = {"revision": "step20", "commit": "a" * 40, "model": REPO, "settings": {}, "order": 0, "step": 20}
    series = tmp_path / "series.jsonl"
    series.write_text(json.dumps(row) + "\n" + json.dumps({**row, "revision": "step100"})[:30])
    assert read_rows(series) == [row]
    assert "series.jsonl:2" in capsys.readouterr().err
    series.write_text(json.dumps(row)[:30] + "\n" + json.dumps(row) + "\n")  # cut in the middle: not a series
    with pytest.raises(ValueError, match="not hf-flatbias series rows"):
        read_rows(series)


def _populate_cache(revisions):
    from huggingface_hub import snapshot_download

    return {revision: snapshot_download(REPO, revision=revision) for revision in revisions}


def _go_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_series_runs_offline_from_the_cache(hub, checkpoints, tmp_path, monkeypatch, capsys):
    folders, data, tokenizer, lines = checkpoints
    commits = {name: ref.target_commit for ref in HfApi().list_repo_refs(REPO).branches for name in [ref.name]}
    _populate_cache(["step20", "step100"])
    _go_offline(monkeypatch)
    output = tmp_path / "offline.jsonl"
    assert main(_trace_args(data, output, "--revisions", "step20,step100")) == 0, capsys.readouterr().err
    rows = read_rows(output)
    assert [(row["revision"], row["commit"]) for row in rows] == [
        ("step20", commits["step20"]), ("step100", commits["step100"])
    ]  # fmt: skip
    assert rows[1]["estimate"]["mean"] == pytest.approx(_library_trace(folders[1], tokenizer, lines), rel=1e-6)

    # a pattern offline matches the refs the cache holds, and says so
    assert main(_trace_args(data, output, "--revisions", "step*")) == 0
    printed = capsys.readouterr()
    assert "skipped: step20, step100" in printed.out and "local cache" in printed.err

    # a revision the cache does not hold is refused before anything is measured
    _measure_must_not_run(monkeypatch)
    assert main(_trace_args(data, tmp_path / "other.jsonl", "--revisions", "step20,step300")) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "step300" in error and "HF_HUB_OFFLINE" in error


def test_an_unreachable_hub_is_one_line_naming_the_fix(checkpoints, tmp_path, monkeypatch, capsys):
    import socket

    with socket.socket() as closed:  # a port nothing listens on once the socket is closed
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    point_hub_client_at(endpoint, monkeypatch, str(tmp_path / "hf_home"))
    _measure_must_not_run(monkeypatch)
    for revisions in ("step*", "step20,step100"):
        assert main(_trace_args(checkpoints[1], tmp_path / "s.jsonl", "--revisions", revisions)) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1, error
        assert "could not be reached" in error and "HF_HUB_OFFLINE=1" in error and "HF_ENDPOINT" in error


def test_a_missing_revision_is_refused_before_any_is_measured(hub, checkpoints, tmp_path, monkeypatch, capsys):
    _measure_must_not_run(monkeypatch)
    output = tmp_path / "s.jsonl"
    assert main(_trace_args(checkpoints[1], output, "--revisions", "step20,step2000")) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "step2000" in error and "--revisions" in error
    assert not output.exists()


def test_a_branch_that_moved_is_measured_again(hub, checkpoints, tmp_path, capsys):
    folders, data, tokenizer, lines = checkpoints
    output = tmp_path / "s.jsonl"
    assert main(_trace_args(data, output, "--revisions", "step20")) == 0
    before = read_rows(output)
    moved = HfApi().upload_folder(repo_id=REPO, folder_path=folders[2], revision="step20", commit_message="moved")
    capsys.readouterr()
    assert main(_trace_args(data, output, "--revisions", "step20")) == 0
    printed = capsys.readouterr().out
    assert "step20 now points at" in printed and "measured again" in printed
    rows = read_rows(output)
    assert rows[0] == before[0]  # the earlier commit's row is kept
    assert rows[1]["revision"] == "step20" and rows[1]["commit"] == moved.oid
    assert rows[1]["estimate"]["mean"] == pytest.approx(_library_trace(folders[2], tokenizer, lines), rel=1e-6)


def test_trace_reads_repo_at_revision_as_card_and_compare_do(hub, checkpoints, tmp_path, capsys):
    folders, data, tokenizer, lines = checkpoints
    output = tmp_path / "one.json"
    at_revision = [f"{REPO}@v1" if item == REPO else item for item in _trace_args(data, output)]
    assert main(at_revision) == 0
    written = json.loads(output.read_text())
    assert written["model"] == REPO and written["revision"] == "v1"
    assert f"Tr(F) of {REPO}@v1: " in capsys.readouterr().out
    assert written["estimate"]["mean"] == pytest.approx(_library_trace(folders[1], tokenizer, lines), rel=1e-6)
    assert main([*at_revision, "--revision", "step20"]) == 2
    assert "two revisions" in capsys.readouterr().err
    series = [f"{REPO}@v1" if item == REPO else item for item in _trace_args(data, tmp_path / "s.jsonl")]
    assert main([*series, "--revisions", "step20"]) == 2
    assert "--revisions" in capsys.readouterr().err
