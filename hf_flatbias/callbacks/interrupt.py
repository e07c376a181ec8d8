"""`SaveOnInterruptCallback`: Ctrl-C saves a checkpoint after the step in progress instead of losing every step since
the last save."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger(__name__)


class SaveOnInterruptCallback(TrainerCallback):
    """On Ctrl-C during training: finish the optimizer step in progress, save a checkpoint, then interrupt.

    The Trainer saves only on its schedule, so an interrupt loses every step since the last save. With this callback
    the first signal asks the Trainer to save (``control.should_save``) at the end of the current step; once
    ``checkpoint-N`` is written (model, optimizer, scheduler and random states) ``trainer.train()`` raises
    ``KeyboardInterrupt``, as Ctrl-C does without the callback, and nothing else runs (no end-of-training
    measurement, no final save). ``trainer.train(resume_from_checkpoint=True)`` continues from the checkpoint. A
    second signal interrupts at once. `interrupted` says whether training stopped this way.

    The handler is installed from ``on_train_begin`` until training ends, in the main thread only. With several
    processes the ranks agree on the step to stop at (one all-reduce of a flag per step), so they save together.

    Args:
        signals: the signals handled this way, as numbers, `signal.Signals` or names (``"SIGTERM"``); default
            ``SIGINT``, Ctrl-C. Checked when the callback is made.
    """

    def __init__(self, signals: Sequence[int | str] = (signal.SIGINT,)) -> None:
        self.signals = resolve_signals(signals)
        self.interrupted = False
        self._requested = False
        self._previous: dict[int, Any] = {}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.interrupted = self._requested = False
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._request) for number in self.signals}

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if _any_rank(self._requested, args.device):
            self.interrupted = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self.interrupted:
            return
        self._restore_handlers()
        if state.is_world_process_zero:
            logger.warning(
                "Interrupted: saved %s; train(resume_from_checkpoint=True) continues from it.",
                os.path.join(args.output_dir, f"checkpoint-{state.global_step}"),
            )
        raise KeyboardInterrupt

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _request(self, number: int, frame: Any) -> None:
        if self._requested:  # the second signal: stop now, as without this callback
            self._restore_handlers()
            raise KeyboardInterrupt
        self._requested = True
        print(
            "Interrupt: saving a checkpoint after the current step (interrupt again to stop at once).",
            file=sys.stderr,
            flush=True,
        )


def resolve_signals(signals: Sequence[int | str] | int | str) -> tuple[signal.Signals, ...]:
    """``signals`` as `signal.Signals`, or `ValueError` naming the one that cannot be handled here."""
    if isinstance(signals, int | str):
        signals = (signals,)
    uncatchable = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}
    resolved = []
    for value in signals:
        try:
            number = signal.Signals[value.upper()] if isinstance(value, str) else signal.Signals(value)
        except (KeyError, ValueError):
            number = None
        if number is None or isinstance(value, bool) or number in uncatchable:
            raise ValueError(
                f"signals={tuple(signals)!r}: {value!r} is not a signal this platform lets a program handle; pass "
                "names such as 'SIGINT' or 'SIGTERM', or signal.SIGINT."
            )
        resolved.append(number)
    return tuple(resolved)


def _any_rank(flag: bool, device: Any) -> bool:
    """``flag`` or-ed over the processes of a distributed run; ``flag`` itself in one process."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
