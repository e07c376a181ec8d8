"""Reading a flatness card from a checkpoint folder, a card file or a Hub repository (at a revision), and adding GLUE
results to a local one."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard

from ..hub import split_revision
from .card import CARD_FILENAME, FlatnessCard, looks_like_repo_id


def load_flatness_card(
    repo_id_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> FlatnessCard:
    """Read the flatness card of a local checkpoint folder, a README file, or a Hub repository.

    Args:
        repo_id_or_path: a folder holding ``README.md``, the path of a card file, or a Hub repo id
            (``"user/model"``, or ``"user/model@revision"``), downloaded with `huggingface_hub.hf_hub_download`
            (honours ``HF_ENDPOINT``).
        revision: branch, tag or commit of the Hub repository (ignored for local paths); the same as ``@revision``
            after the repo id (giving two different ones is refused).
        token: Hub token, as for `hf_hub_download`.
        cache_dir: Hub cache folder, as for `hf_hub_download`.

    Raises:
        ValueError: the README has no ``flatness:`` block, its YAML front matter cannot be parsed, a field is not a
            number where one is expected, or a local-looking path does not exist. Non-finite numbers are read as
            unknown, with a warning.
    """
    local = Path(repo_id_or_path)
    if local.is_dir():
        card_path = local / CARD_FILENAME
        if not card_path.is_file():
            raise ValueError(
                f"{local} has no {CARD_FILENAME}: save the checkpoint with FlatBiasTrainer (it writes the card) or "
                "write one with FlatnessCard(...).save(folder)."
            )
    elif local.is_file():
        card_path = local
    else:
        name, revision = split_revision(str(repo_id_or_path), revision)
        if not looks_like_repo_id(name):
            raise ValueError(f"{name!r} is neither an existing file or folder nor a Hub repo id like 'user/model'.")
        card_path = _download_card(name, revision=revision, token=token, cache_dir=cache_dir)
    source = str(card_path) if local.exists() else f"{repo_id_or_path} ({CARD_FILENAME})"
    try:
        card = ModelCard(card_path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, ValueError, KeyError, TypeError) as error:
        # yaml's messages span several lines with a caret; the first line says what is wrong
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"{source}: the card's YAML metadata cannot be read ({reason}). Fix the front matter between the two "
            "'---' lines, or write the card again with FlatnessCard(...).save(folder)."
        ) from error
    return FlatnessCard.from_model_card(card, source=source)


def add_glue_results(path: str | os.PathLike, glue_results: Mapping[str, Mapping[str, float]]) -> FlatnessCard:
    """Merge GLUE results (``{"sst2": {"accuracy": 0.91}}``) into the card of a local checkpoint and rewrite it.

    For results measured after pre-training, e.g. by fine-tuning the checkpoint; push the folder again to publish.
    """
    card = load_flatness_card(path)
    glue = {task: dict(metrics) for task, metrics in card.glue.items()}
    for task, metrics in glue_results.items():
        glue.setdefault(task, {}).update({metric: float(value) for metric, value in metrics.items()})
    card.glue = glue
    card_path = Path(path) / CARD_FILENAME if Path(path).is_dir() else Path(path)
    card_path.write_text(card.render(), encoding="utf-8")
    return card


def _download_card(repo_id: str, **download: Any) -> Path:
    """The card file of a Hub repository; a missing repository, revision or card, or an offline client, raises
    `ValueError` in one line (huggingface_hub's text spans up to seven)."""
    from huggingface_hub import hf_hub_download

    from ..hub import hub_download_error

    try:
        return Path(hf_hub_download(repo_id, CARD_FILENAME, **download))
    except Exception as error:
        explained = hub_download_error(error, repo_id, CARD_FILENAME, download.get("revision"))
        if explained is None:
            raise
        raise ValueError(explained) from error
