"""The flatness card on every save and every push: the bodies of `FlatnessTrainerMixin`'s ``create_model_card``,
``push_to_hub``, ``_save`` and ``_push_from_checkpoint``, which stay thin overrides that call these.

transformers' own card keeps only whitelisted metric names and would drop the Hessian trace, so every card the
trainer writes (checkpoints, final save, pushes) is the flatness card. The trainer is read duck-typed, as in
`flatness_card_from_trainer`, and nothing here imports torch or transformers.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from huggingface_hub.errors import HfHubHTTPError

from .card import FlatnessCard

logger = logging.getLogger(__name__)

#: The arguments of `flatness_card_from_trainer` that ``create_model_card`` and ``push_to_hub`` accept and remember.
CARD_METADATA_KEYS = (
    "language",
    "license",
    "tags",
    "model_name",
    "finetuned_from",
    "dataset",
    "glue_results",
    "pretraining_corpus",
)


def card_metadata(given: Mapping[str, Any], remembered: Mapping[str, Any] = {}) -> dict[str, Any]:  # noqa: B006
    """``remembered`` updated with the card metadata in ``given`` that has a value (other keys are ignored)."""
    return {**remembered, **{key: given[key] for key in CARD_METADATA_KEYS if given.get(key) is not None}}


def save_card_beside_weights(flatness_card: Callable[[], FlatnessCard], output_dir: str) -> None:
    """Write the card into a folder whose weights were just saved; a card that cannot be written (a non-finite
    trace) is reported, not raised: a local checkpoint is never lost over its card (pushes re-check and refuse)."""
    try:
        flatness_card().save(output_dir)
    except ValueError as error:
        logger.warning(f"Saved the checkpoint without a flatness card: {error}")


def card_ready_for_checkpoint_push(trainer: Any) -> bool:
    """Before a ``hub_strategy`` checkpoint push (world rank 0): write the card into ``output_dir``, which the push
    uploads besides the checkpoint folder; ``False`` when transformers should skip this push.

    A non-finite trace stops the push with the card's ``ValueError`` before any upload starts.
    """
    previous = getattr(trainer, "push_in_progress", None)
    if previous is not None and not previous.is_done():
        # A background push still reads output_dir: huggingface_hub hashes each file when the upload starts and
        # reads it again to send it (LFS) or to commit it (README.md). This push overwrites those files (the new
        # weights, the new card), so the earlier push would send bytes that do not match their sha256 (the Hub
        # rejects the upload) or commit one step's weights with another's card.
        if not trainer.args.hub_always_push:
            return False  # transformers skips this push; leave the files of the running one alone
        trainer._finish_current_push()  # push every checkpoint, each intact: one after the other
    trainer.flatness_card().save(trainer.args.output_dir)
    return True


def report_failed_checkpoint_pushes(push_in_progress: Any, checkpoint_folder: str) -> None:
    """transformers runs checkpoint pushes in the background and never reads their result, so a failed upload would
    go unnoticed: report each as soon as it fails."""
    if push_in_progress is None:
        return
    for job in push_in_progress.jobs:
        if not getattr(job, "_flatbias_watched", False):
            job._flatbias_watched = True
            job.add_done_callback(functools.partial(_report_failed_push, checkpoint_folder=checkpoint_folder))


def _report_failed_push(job, checkpoint_folder: str) -> None:
    error = None if job.cancelled() else job.exception()
    if error is not None:
        logger.warning(
            f"Pushing checkpoint {checkpoint_folder} to the Hub failed: {error}\nThe checkpoint on disk is intact; the "
            "next checkpoint push or trainer.push_to_hub() uploads the current state again."
        )


@contextlib.contextmanager
def explained_push_failures(hub_model_id: str | None, output_dir: str) -> Iterator[None]:
    """Around ``push_to_hub``: a failed push says that the saved model is intact and how to retry."""
    advice = (
        f"\nThe push to {hub_model_id} did not complete; the saved model in {output_dir} is intact. Call "
        "trainer.push_to_hub() again to retry (files the Hub already has are skipped)."
    )
    try:
        yield
    except HfHubHTTPError as error:
        error.append_to_message(advice)
        raise
    except hub_transport_errors() as error:
        # No answer from the Hub at all (refused, timed out): the transport's bare error says nothing of the state
        # the run is in.
        raise ConnectionError(f"Could not reach the Hub: {error}{advice}") from error


@functools.cache
def hub_transport_errors() -> tuple[type[BaseException], ...]:
    """The exceptions huggingface_hub's HTTP client raises when no answer arrives (its transport is a dependency
    of huggingface_hub and has changed between versions)."""
    errors: list[type[BaseException]] = []
    for module_name in ("httpx2", "httpx", "requests"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        error = getattr(module, "TransportError", None) or getattr(module, "ConnectionError", None)
        if isinstance(error, type):
            errors.append(error)
    return tuple(errors)
