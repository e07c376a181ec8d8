"""Checks a checkpoint before training resumes from it: intact files, and a model of the same shape; and a lock
that keeps two trainings from writing one ``output_dir`` at once.

Without them a truncated ``model.safetensors`` or a half-written ``trainer_state.json`` surfaces as a raw
deserialisation traceback, and a checkpoint of another model size (a ``--smoke`` run left in the same folder, say)
as a wall of size-mismatch errors, both after the model and the data were built.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "config.json"

# config keys that decide the shapes of the weights: a checkpoint that differs in any cannot be loaded
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
)


class CheckpointError(ValueError):
    """A checkpoint that training cannot resume from; the message names the file and what to do."""


def checkpoint_problem(checkpoint: str | Path, model_config: Any | None = None) -> str | None:
    """What makes ``checkpoint`` unusable for resuming (one sentence), or ``None`` if it looks intact.

    Reads every JSON file the resume reads, the header of every safetensors file (which records how long the file
    must be: a truncated file is caught without loading a tensor), and with ``model_config`` compares the weight
    shapes it implies (`SHAPE_KEYS`) with the checkpoint's ``config.json``.
    """
    folder = Path(checkpoint)
    if not folder.is_dir():
        return f"{folder} is not a folder"
    for path in sorted(folder.glob("*.json")):
        try:
            saved = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return f"{path} is not valid JSON ({error.__class__.__name__}: {error}); the file is damaged"
        if path.name == MODEL_CONFIG and model_config is not None:
            mismatch = _shape_mismatch(saved, _as_dict(model_config))
            if mismatch:
                return f"{path} describes another model ({mismatch})"
    if not (folder / TRAINER_STATE).is_file():
        return f"{folder / TRAINER_STATE} is missing"
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path} is damaged ({problem})"
    return None


def checkpoint_to_resume(resume_from_checkpoint: str | bool, output_dir: str, model_config: Any | None = None) -> str:
    """The checkpoint folder `Trainer.train` is asked to resume from (``True``: the last one in ``output_dir``),
    checked with `check_resumable` before any state is loaded."""
    if resume_from_checkpoint is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            # transformers' own words first: code that matches Trainer's message matches this one
            raise ValueError(
                f"No valid checkpoint found in output directory ({output_dir}): resume_from_checkpoint=True but it "
                "holds no checkpoint-* folder; start without resuming or pass the checkpoint's path."
            )
        resume_from_checkpoint = last
    check_resumable(resume_from_checkpoint, model_config)
    return resume_from_checkpoint


def check_resumable(checkpoint: str | Path, model_config: Any | None = None) -> None:
    """Raise `CheckpointError` naming the damaged or mismatched file and the newest intact earlier checkpoint."""
    problem = checkpoint_problem(checkpoint, model_config)
    if problem is None:
        return
    folder = Path(checkpoint)
    if "another model" in problem:
        fix = (
            "train into a new --output_dir, or delete the old checkpoints if they are no longer needed "
            "(a --smoke run writes to its own <output_dir>-smoke folder)"
        )
    else:
        earlier = newest_intact_checkpoint(folder.parent, before=folder, model_config=model_config)
        fix = (
            f"resume from the previous intact checkpoint with resume_from_checkpoint={str(earlier)!r}"
            if earlier is not None
            else "no earlier intact checkpoint exists; start without resume_from_checkpoint in a new output_dir"
        )
    # a folder that fails the checks is what Trainer calls one without weights: its words first, then which file
    raise CheckpointError(f"Can't find a valid checkpoint at {checkpoint}: {problem}. Nothing was changed; {fix}.")


def newest_intact_checkpoint(
    output_dir: str | Path, *, before: str | Path | None = None, model_config: Any | None = None
) -> Path | None:
    """The ``checkpoint-N`` folder of ``output_dir`` with the largest N (below ``before``'s) that is intact."""
    limit = _step_of(Path(before)) if before is not None else None
    candidates = [
        path
        for path in Path(output_dir).glob("checkpoint-*")
        if _step_of(path) is not None and (limit is None or _step_of(path) < limit)
    ]
    for path in sorted(candidates, key=_step_of, reverse=True):
        if checkpoint_problem(path, model_config) is None:
            return path
    return None


def _step_of(path: Path) -> int | None:
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(match.group(1)) if match else None


def _as_dict(config: Any) -> dict[str, Any]:
    return config.to_dict() if hasattr(config, "to_dict") else dict(config)


def _shape_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    differences = [
        f"{key} {saved[key]} there, {current[key]} here"
        for key in SHAPE_KEYS
        if key in saved and key in current and saved[key] != current[key]
    ]
    return ", ".join(differences) or None


def _safetensors_problem(path: Path) -> str | None:
    # layout: 8-byte little-endian header length, the JSON header, then the data the header's offsets cover
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, shorter than a safetensors header"
        header_length = int.from_bytes(prefix, "little")
        if header_length > size - 8:
            return "the header runs past the end of the file: truncated"
        try:
            header = json.loads(handle.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "its header is not valid JSON"
    ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    expected = 8 + header_length + max(ends, default=0)
    if size < expected:
        return f"{size} bytes where its header needs {expected}: truncated"
    return None


OUTPUT_DIR_LOCK = "_flatbias_training.lock"
"""Lock file of a training in progress (a leading ``_``: the Trainer's pushes to the Hub skip it)."""


@contextlib.contextmanager
def output_dir_lock(output_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``output_dir/_flatbias_training.lock`` (this process's id and host) while the block runs.

    Two trainings writing one folder interleave their checkpoints and cards and both exit 0; the second is refused
    here instead, before it trains. A lock left by a process that has died (a crash, a kill) is taken over.

    Raises:
        ValueError: another live process on this host holds the lock, or a process on another host does (its
            liveness cannot be checked from here; the message names the file to delete once it has stopped).
    """
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / OUTPUT_DIR_LOCK
    mine = {"pid": os.getpid(), "host": socket.gethostname()}
    acquired = False
    for _ in range(2):  # a second try after removing a dead holder's lock
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = _lock_holder(lock)
            if holder is not None and holder.get("host") == mine["host"] and not _process_alive(holder.get("pid")):
                lock.unlink(missing_ok=True)  # the holder died without removing it
                continue
            who = f"process {holder.get('pid')} on {holder.get('host')}" if holder else "another process"
            raise ValueError(
                f"{folder} is being written by another training ({who}, lock file {lock}): two trainings in one "
                "output_dir overwrite each other's checkpoints. Use another output_dir, or wait for it to finish "
                "(delete the lock file only if that training has stopped)."
            ) from None
        with os.fdopen(descriptor, "w") as handle:
            json.dump(mine, handle)
        acquired = True
        break
    if not acquired:
        raise ValueError(f"{lock} is taken and released over and over by other processes; use another output_dir.")
    try:
        yield
    finally:
        if _lock_holder(lock) == mine:
            lock.unlink(missing_ok=True)


def _lock_holder(lock: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None  # gone, or being written this instant
    return holder if isinstance(holder, dict) else None


def _process_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def tied_missing_keys(model: Any, missing_keys: list[str]) -> set[str]:
    """The ``missing_keys`` of a checkpoint load whose tensor is the very tensor of a key that was loaded (tied
    weights: BERT's decoder and word embeddings, also inside a wrapper that is not a `PreTrainedModel`): nothing is
    lost."""
    missing = set(missing_keys)
    tensors = dict(model.state_dict(keep_vars=True))
    loaded = {id(tensor) for key, tensor in tensors.items() if key not in missing}
    return {key for key in missing if key in tensors and id(tensors[key]) in loaded}


def state_dict_without_shared_tensors(model: Any) -> dict[str, Any]:
    """``model``'s state dict with one name per tensor (the first): safetensors refuses a tensor saved under two
    names, which the Trainer's bare state-dict save of a model that is not a `PreTrainedModel` would do for tied
    weights; the load puts the tensor back under every name (`tied_missing_keys`)."""
    seen: set[int] = set()
    kept = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            kept[key] = tensor.detach()
    return kept


def saved_with_save_pretrained(model: Any) -> bool:
    """Whether the Trainer saves ``model`` with ``save_pretrained`` (which handles tied weights) rather than as a bare
    state dict."""
    from transformers import PreTrainedModel
    from transformers.utils import is_peft_available

    if isinstance(model, PreTrainedModel):
        return True
    if is_peft_available():
        from peft import PeftModel

        return isinstance(model, PeftModel)
    return False
