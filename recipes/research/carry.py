"""What of campaign v2's work folder outlives a session: copied into a tracked folder and back.

A session's checkout keeps what git holds; the work folder (``outputs/campaign_v2``, ignored) goes with the session,
and with it every trunk checkpoint and kept branch a later session needs (a 40,000-step unit outlasts a session, and a
finished unit's branches wait for their read-outs). `carry_out`, run at each snapshot with the runs paused, copies
into ``results/campaign_v2/carry`` (same relative paths as the work folder) every run folder's ``branches.json``, its
kept branches' weights and, while its trunk is still training, the trunk's newest intact checkpoint (weights,
optimizer, scheduler, random states); a finished trunk's carried checkpoint is dropped. `carry_in`, run as each phase
starts, copies the carried files and the committed starts' weights (``results/campaign_v2/starts``, where the
starts phase's JSON points into the work folder) back into the work folder, never over a file already there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hf_flatbias.checkpoints import newest_intact_checkpoint

BRANCH_FILES = ("config.json", "model.safetensors")


def run_folders(work_dir: Path) -> list[Path]:
    """Every folder of ``work_dir`` that `research.protocol.train_with_branches` wrote (it holds ``branches.json``)."""
    return sorted(path.parent for path in work_dir.rglob("branches.json"))


def trunk_finished(checkpoint: Path) -> bool:
    """True when ``checkpoint``'s trainer state is at its run's last step."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return int(state["global_step"]) >= int(state["max_steps"])


def _copy_file(source: Path, target: Path) -> bool:
    if (
        target.exists()
        and target.stat().st_size == source.stat().st_size
        and target.read_bytes() == source.read_bytes()
    ):
        return False
    _copy_whole(source, target)
    return True


def _copy_whole(source: Path, target: Path) -> None:
    """Copy through a sibling named by the process, renamed over ``target``: a process starting beside another
    (two claims processes) never sees, and never skips as present, a half-copied file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.copy2(source, partial)
    os.replace(partial, target)


def carry_out(work_dir: Path, carry: Path) -> list[str]:
    """Copy what a later session needs of ``work_dir`` into ``carry``; returns the paths (relative) written or
    removed. Run with the campaign paused: a checkpoint being written is skipped as not intact."""
    changed = []
    for folder in run_folders(work_dir):
        relative = folder.relative_to(work_dir)
        if _copy_file(folder / "branches.json", carry / relative / "branches.json"):
            changed.append(str(relative / "branches.json"))
        for branch in sorted((folder / "branches").glob("step-*")):
            for name in BRANCH_FILES:
                if (branch / name).exists() and _copy_file(
                    branch / name, carry / relative / "branches" / branch.name / name
                ):
                    changed.append(str(relative / "branches" / branch.name / name))
        newest = newest_intact_checkpoint(folder / "trunk") if (folder / "trunk").is_dir() else None
        keep = newest if newest is not None and not trunk_finished(newest) else None
        carried_trunk = carry / relative / "trunk"
        for old in sorted(carried_trunk.glob("checkpoint-*")):
            if keep is None or old.name != keep.name:
                shutil.rmtree(old)
                changed.append(f"removed {relative / 'trunk' / old.name}")
        if keep is not None:
            for source in sorted(p for p in keep.rglob("*") if p.is_file()):
                if _copy_file(source, carried_trunk / keep.name / source.relative_to(keep)):
                    changed.append(str(relative / "trunk" / keep.name / source.relative_to(keep)))
    return changed


def carry_in(results_dir: Path, work_dir: Path) -> list[str]:
    """Copy the carried files (``results_dir/carry``) and the committed starts (``results_dir/starts``) into
    ``work_dir`` where it lacks them; returns the paths (relative) copied."""
    copied = []
    for tree in (results_dir / "carry", results_dir / "starts"):
        for source in sorted(p for p in tree.rglob("*") if p.is_file()):
            relative = source.relative_to(results_dir / "carry" if tree.name == "carry" else results_dir)
            target = work_dir / relative
            if not target.exists():
                _copy_whole(source, target)
                copied.append(str(relative))
    return copied
