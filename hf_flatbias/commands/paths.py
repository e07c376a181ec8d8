"""Tell a mistyped local path from a Hub id before anything is loaded.

Without this check a missing folder such as ``./runs/sam`` is handed to ``from_pretrained``, which retries the Hub
for half a minute and then blames the connection. Hub ids are ``name`` or ``namespace/name`` and never start with
``.``, ``/`` or ``~``; anything else is meant as a local path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def looks_like_local_path(value: str, file_suffixes: tuple[str, ...] = ()) -> bool:
    """Whether ``value`` can only mean a local path (it need not exist).

    Args:
        value: a command-line argument naming a checkpoint, card or data set.
        file_suffixes: endings (lower case, with the dot) of files the argument may name, e.g. ``(".md",)``:
            ``README.md`` is a file, not a Hub model called that.
    """
    if value.startswith((".", "/", "~")) or "\\" in value or ":" in value:  # ":" and "\\": Windows paths
        return True
    if file_suffixes and value.lower().endswith(file_suffixes):
        return True
    parts = value.split("/")
    # "runs/sam" names a Hub repo only if there is no ./runs here: a folder that exists in part was meant.
    return len(parts) > 2 or (len(parts) == 2 and os.path.exists(parts[0]))


def local_path_or_hub_id(value: str, label: str, *, file_suffixes: tuple[str, ...] = ()) -> str:
    """``value`` with ``~`` expanded when it is an existing local path or a Hub id.

    Raises:
        FileNotFoundError: ``value`` looks like a local path and does not exist; the message names it.
    """
    path = os.path.expanduser(value)
    if os.path.exists(path):
        return path
    if looks_like_local_path(value, file_suffixes):
        raise FileNotFoundError(
            f"{label} {value}: no such file or folder (check the path; a Hub id is written namespace/name)."
        )
    return value


def existing_local_path(value: str, label: str) -> str:
    """``value`` with ``~`` expanded; raises `FileNotFoundError` naming it if it does not exist."""
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{label} {value}: no such file or folder.")
    return path


def check_output_file(value: str, label: str, *, own: Callable[[Path], bool] | None = None, own_name: str = "") -> None:
    """Raise naming ``label`` when ``value`` cannot become a file: it is a folder, or a file stands where one of its
    folders would be, or the nearest existing folder is not writable. Checked before any compute; nothing is made.

    With ``own``, an existing file is written over only when ``own(path)`` recognises it as the command's own output
    (``own_name`` says what that is, e.g. "an hf-flatbias trace result"; see `json_object_with` and
    `is_matplotlib_figure`). Any other file (a data set, notes) was named by mistake and is refused: nothing a user
    wrote is replaced."""
    path = Path(value).expanduser()
    if path.is_dir():
        raise IsADirectoryError(f"{label} {value} is a folder; name a file.")
    if (
        own is not None
        and path.exists()
        and not (path.is_file() and path.stat().st_size <= OWN_FILE_LIMIT and own(path))
    ):
        raise FileExistsError(
            f"{label} {value} exists and is not {own_name}, so it is not written over; pass another {label}."
        )
    _check_can_make(path.parent, value, label)


OWN_FILE_LIMIT = 64 * 2**20
"""Bytes: a larger file is not one of the commands' results or figures, and is not read to find that out."""


def json_object_with(*keys: str) -> Callable[[Path], bool]:
    """``own`` for `check_output_file`: a file holding a JSON object with every one of ``keys``."""

    def holds(path: Path) -> bool:
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
        return isinstance(content, dict) and all(key in content for key in keys)

    return holds


FIGURE_OWNER = "a figure drawn by matplotlib"
"""What `is_matplotlib_figure` recognises, for `check_output_file`'s ``own_name``."""


def is_matplotlib_figure(path: Path) -> bool:
    """``own`` for `check_output_file`'s ``--plot``: a PNG, PDF or SVG that names matplotlib as its writer, as the
    figures hf-flatbias draws do (a PNG's Software text, a PDF's Producer, an SVG's comment)."""
    return b"matplotlib" in path.read_bytes().lower()


def check_output_folder(
    value: str, label: str, *, own_entries: Callable[[str], bool] | None = None, own_name: str = ""
) -> None:
    """Raise naming ``label`` when ``value`` cannot be (or become) a folder written into: it is a file, a file stands
    where one of its folders would be, or the nearest existing folder is not writable. Nothing is made.

    With ``own_entries``, an existing folder is written into only when it is empty or the command's own: every name
    in it passes ``own_entries`` (``own_name`` says who writes them, e.g. "the demo"). A folder holding anything else
    was named by mistake and is refused: nothing a user wrote is replaced or mixed with the command's files."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{label} {value} is a file; name a folder.")
    if own_entries is not None and path.is_dir():
        foreign = sorted(entry.name for entry in path.iterdir() if not own_entries(entry.name))
        if foreign:
            raise FileExistsError(
                f"{label} {value} holds {foreign[0]!r}{' and more' if len(foreign) > 1 else ''}, which {own_name} "
                f"does not write; pass a new or empty {label}."
            )
    _check_can_make(path, value, label)


def _check_can_make(folder: Path, value: str, label: str) -> None:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise NotADirectoryError(f"{label} {value}: {folder} is a file, so no folder can be made there.")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{label} {value}: {folder} is not writable.")


CHECKPOINT_JSON_FILES = ("config.json", "adapter_config.json")


def check_local_checkpoint(path: str, label: str) -> None:
    """Read a local checkpoint's ``config.json`` and ``adapter_config.json`` before transformers loads (seconds):
    one that is not JSON, or an adapter whose base model is a missing folder, raises `ValueError` naming the file.
    A Hub id, or a folder without these files, passes: loading says what is wrong with it."""
    folder = Path(path)
    if not folder.is_dir():
        return
    check_not_demo_folder(path, label)
    for name in CHECKPOINT_JSON_FILES:
        file = folder / name
        if not file.is_file():
            continue
        try:
            content = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(
                f"{label} {path}: {file} is not a valid JSON file ({error}); the checkpoint is damaged: save it again "
                "(model.save_pretrained) or point at another checkpoint."
            ) from None
        if not isinstance(content, dict):
            raise ValueError(f"{label} {path}: {file} holds {type(content).__name__}, not a JSON object of settings.")
    from .trace_inputs import peft_base_model

    base = peft_base_model(path)
    if base is not None:
        adapter = folder / "adapter_config.json"
        local_path_or_hub_id(base, f"{label} {path}: the base model in {adapter}, base_model_name_or_path")


DEMO_RUNS = {"adamw": "none", "sam": "sam"}
"""The demo's runs, one folder each under its output folder: run label -> flatness_method."""


DEMO_JSON, DEMO_PLOT = "demo.json", "demo.png"
"""What the demo writes beside its run folders: the numbers and the plot."""


def is_demo_entry(name: str) -> bool:
    """Whether ``name`` in a folder is one the demo writes (a run folder, its JSON or plot, a JSON cut short)."""
    partial = name.startswith(f"{DEMO_JSON}.") and name.endswith(".partial")  # write_json's, of a demo killed
    return name in (*DEMO_RUNS, DEMO_JSON, DEMO_PLOT) or partial


def is_demo_folder(folder: Path) -> bool:
    """Whether ``folder`` is the demo's output folder (one run folder per optimizer), not a checkpoint or card."""
    return (folder / DEMO_JSON).is_file() or all((folder / label).is_dir() for label in DEMO_RUNS)


def check_not_demo_folder(path: str, label: str) -> None:
    """Refuse the demo's output folder where one run (a checkpoint, a card) is meant, naming the runs in it."""
    folder = Path(path)
    if folder.is_dir() and not (folder / "config.json").is_file() and is_demo_folder(folder):
        runs = " or ".join(str(folder / run) for run in DEMO_RUNS)
        raise ValueError(f"{label} {path} is the demo's output folder, one run per optimizer: pick {runs}.")


PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""The figure formats ``--plot`` writes (matplotlib picks the format by the ending)."""


def check_plot_file(path: str | None) -> None:
    """``--plot FILE``: refuse an ending matplotlib would not write as a figure, before anything is measured."""
    if path and Path(path).suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"--plot {path}: use a file ending in one of {list(PLOT_SUFFIXES)}.")


def check_outputs_spare_inputs(
    outputs: dict[str, str | None], inputs: dict[str, str | None], *, folders: bool = False
) -> None:
    """Refuse, before anything is read or measured, an output that would write over an input: the same file (also
    through a link or another spelling), a file inside an input folder (a checkpoint's own files), two outputs on
    one file, and with ``folders`` (outputs that are folders of runs) an input inside the output folder, where a run
    may write its checkpoints. ``outputs`` and ``inputs`` map each flag to its value; ``None`` and inputs that are
    not local paths (Hub ids) are skipped.

    Raises:
        ValueError: one line naming both flags and the fix.
    """
    written = {flag: Path(value).expanduser() for flag, value in outputs.items() if value is not None}
    read = {
        flag: Path(value).expanduser()
        for flag, value in inputs.items()
        if value is not None and Path(value).expanduser().exists()
    }
    for flag, output in written.items():
        for input_flag, source in read.items():
            if _same_path(output, source):
                raise ValueError(
                    f"{flag} {output} is {input_flag} {source}: writing it would replace what {input_flag} reads; "
                    f"pass another {flag}."
                )
            if source.is_dir() and _inside(output, source):
                raise ValueError(
                    f"{flag} {output} lies inside {input_flag}'s folder {source}, which is read: pass another {flag} "
                    "outside it, so no file of it is replaced."
                )
            if folders and _inside(source, output):
                raise ValueError(
                    f"{flag} {output} holds {input_flag} {source}, and the runs write their checkpoints there: pass "
                    f"another {flag} outside it."
                )
    flags = list(written)
    for index, flag in enumerate(flags):
        for other in flags[index + 1 :]:
            if _same_path(written[flag], written[other]):
                raise ValueError(f"{flag} and {other} name one file, {written[flag]}: pass another {other}.")


def _same_path(first: Path, second: Path) -> bool:
    # samefile sees hard links too; resolve() covers a path that does not exist yet
    if first.exists() and second.exists():
        return os.path.samefile(first, second)
    return first.resolve() == second.resolve()


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve()) and not _same_path(path, folder)
