"""Campaign v2's pre-registered rules (issue 33), as constants the code reads: committed before any v2 run.

Phases covered here (KL and trace only; no probe is read in them):

**Starts (the margin).** Every start is distilled to a margin inside the saturated tier so that continued branches
keep it: stop-set KL ``<= MARGIN_KL`` (0.007) with the bootstrap upper end ``<= MARGIN_KL_UPPER`` (0.010). The
decision reads the distillation's own held-out stop set (v1's, never the KL set the claims are measured on); the
start is then measured on v1's KL set (KL, Fisher trace) and both are reported. v1's committed start of a width and
seed is reused as is when its recorded stop-set KL already meets the margin; otherwise it gets further decays, each
``EXTENSION_STEPS`` (4,000) steps from the previous weights with a fresh AdamW (beta2 0.98, weight decay 0.01, clip
1), warm-up ``EXTENSION_WARMUP`` then a linear decay to 0 from ``EXTENSION_PEAK`` (5e-4, v1's first extension peak),
measured on the stop set only at each decay's end (no early stop mid-decay), at most ``MAX_EXTENSIONS`` (3) decays.
A width without a v1 start (H48) first gets v1's schedule run to its end (``FIRST_DECAY``: 8,000 steps, peak 2e-3,
warm-up 200), then the same extensions. A start that misses the margin after ``MAX_EXTENSIONS`` is recorded as
missed (its best decay kept) and its seed is not used in the saturated tier at that width; nothing else is tuned.
Widths ``WIDTHS`` for C2 (H48 / H64 / H128; H32 dropped: in v1 it never reached KL 0.010 in 16,000 steps), model
seeds ``SEEDS`` (five per claim), the saturated tier primary in every claim (matched only as a sensitivity row).

**Pilots (seed ``PILOT_SEED``'s start, one branch annealed ``ANNEAL_STEPS`` to lr 0, KL and Fisher trace only).**
A pilot branch "stays saturated" when its KL-set KL ``<= SATURATED_KL`` (0.010) and its upper end
``<= SATURATED_KL_UPPER`` (0.015): v1's tier, unchanged.

- C1's dose: one H64 trunk at v1's rate ``C1_RATE`` (1e-4), an annealed branch every ``DOSE_BRANCH_EVERY`` steps up to
  the ladder's top; the dose is the **shortest** rung of ``DOSE_LADDER`` whose branch's Fisher trace has fallen by
  ``>= DOSE_MIN_TRACE_FALL`` (20%) relative to the start's (same contexts and draws) while the branch stays saturated.
  The trunk stops at the first rung that qualifies. If none qualifies, the dose is the longest rung whose branch
  stays saturated, and C1 is reported as under-dosed (its measured trace fall beside it); if no rung stays
  saturated, the shortest rung, flagged. No other rate or length is tried.
- C2's rate per width: the **largest** rate of ``RATE_LADDER`` whose pilot branch (that width's seed-0 start, C1's
  chosen dose at that rate) stays saturated, tried from the largest down, stopping at the first saturated; none: the
  smallest, flagged.
- C3's dropout: the **largest** of ``DROPOUT_LADDER`` (all <= 0.1) whose pilot branch (C3's dropout arm: weight decay
  0.01, no SAM, C1's rate and dose) stays saturated, tried from the largest down; none: C3's dropout arms are reported
  as unable to stay saturated (no dropout value below the ladder is tried).
- C5's adversary weight: the **largest** of ``ADVERSARY_LADDER`` whose pilot branch (v1's adversary, C1's rate and
  dose, the branch annealed with the same objective) stays saturated, tried from the largest down; none: C5 is
  reported as unable to stay saturated.

Order of the work (cheapest unit first inside each phase): starts H64 seeds 0-4, then H128, then H48; pilots C1 dose,
then C2 rates (H64, H128, H48), C3 dropout, C5 weight. Each unit's JSON row is written when it finishes; a rerun
skips finished units.

**Lost session (from its log, not reused).** A previous session, cut off before its code and JSON landed, reported
in its log: H64 starts, all 6 seeds met the margin (KL 0.0055-0.0067); H128, 4 of 6 (seed 3 at 0.0071 and seed 4
at 0.0105 missed); H48 none; C1's dose pilot: the Fisher trace fell only 5.4% in 20,000 steps. Its settings are not
known beyond that. This run recomputes everything with the rules above; those numbers are in ``LOST_SESSION`` for
the record only and no code reads them for a decision.
"""

from __future__ import annotations

from typing import Any

from .saturation import SATURATED_KL, SATURATED_KL_UPPER

# -- the margin of every start --
MARGIN_KL = 0.007
MARGIN_KL_UPPER = 0.010
EXTENSION_STEPS = 4000
EXTENSION_PEAK = 5e-4
EXTENSION_WARMUP = 200
MAX_EXTENSIONS = 3
#: v1's first decay, run to its end, for a width without a committed v1 start: (steps, peak, warm-up)
FIRST_DECAY = (8000, 2e-3, 200)

# -- what is run --
WIDTHS = (64, 128, 48)  # the order the starts run in; C2 compares all three
V1_WIDTH = 64  # v1's campaign width: its starts live in campaign_state/seedS/start (others under seedS/hH/start)
SEEDS = (0, 1, 2, 3, 4)
PILOT_SEED = 0
LAYERS = 3
BATCH_SIZE = 128
ANNEAL_STEPS = 500  # v1's branch anneal
CONTINUE_WARMUP = 100  # v1's warm-up of the continued training's fresh AdamW
CONTINUE_WEIGHT_DECAY = 0.01  # v1's continued training (and C3's dropout arm): AdamW weight decay ...
CONTINUE_BETA2 = 0.98  # ... and beta2

# -- pilots --
C1_RATE = 1e-4  # v1's chosen continued-training rate (its rate pilot), fixed for C1's dose ladder
DOSE_LADDER = (5000, 10000, 20000, 40000)
DOSE_BRANCH_EVERY = 5000
DOSE_MIN_TRACE_FALL = 0.20
RATE_LADDER = (4e-4, 2e-4, 1e-4, 5e-5)
DROPOUT_LADDER = (0.1, 0.05, 0.025)
ADVERSARY_LADDER = (1.0, 0.5, 0.25, 0.1)

LOST_SESSION: dict[str, Any] = {
    "status": "lost session, from its log, not reused",
    "starts": {
        "h64": "all 6 seeds met the margin (KL 0.0055-0.0067)",
        "h128": "4 of 6 met it; seed 3 0.0071 and seed 4 0.0105 missed",
        "h48": "none met it",
    },
    "c1_dose_pilot": "Fisher trace fell 5.4% in 20,000 steps",
}

__all__ = [
    "ADVERSARY_LADDER",
    "ANNEAL_STEPS",
    "BATCH_SIZE",
    "C1_RATE",
    "CONTINUE_BETA2",
    "CONTINUE_WARMUP",
    "CONTINUE_WEIGHT_DECAY",
    "DOSE_BRANCH_EVERY",
    "DOSE_LADDER",
    "DOSE_MIN_TRACE_FALL",
    "DROPOUT_LADDER",
    "EXTENSION_PEAK",
    "EXTENSION_STEPS",
    "EXTENSION_WARMUP",
    "FIRST_DECAY",
    "LAYERS",
    "LOST_SESSION",
    "MARGIN_KL",
    "MARGIN_KL_UPPER",
    "MAX_EXTENSIONS",
    "PILOT_SEED",
    "RATE_LADDER",
    "SATURATED_KL",
    "SATURATED_KL_UPPER",
    "SEEDS",
    "V1_WIDTH",
    "WIDTHS",
]
