"""Campaign v2's pre-registered rules (issue 33), as constants the code reads: each phase's committed before its run.

Phases covered here: the starts and the pilots read the KL and the Fisher trace only (no probe); the claims read
the ruler (RULES.md), on the checkpoints their rules compare.

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

**Claims (phase ``claims``; rules committed before its first run, after the starts' and pilots' rules).** The
claims keep v1's definitions of what C1..C6 compare (``verdicts.C1_RULE`` .. ``C6_RULE``, quoted in RULES_v2.md);
what changes is the read-out, the tier, the doses and the intervals:

- *The ruler* (the gate's, RULES.md, unchanged): linear probes (``hf_flatbias.probe.fit_probe``, C fixed at
  ``RULER_C`` = 0.3, the gate's 3-fold cross-validated value, max_iter ``RULER_MAX_ITER``) on the last layer's states
  at every position of ``[CLS] words [SEP]`` concatenated, tasks A/B/C, fitted on each of ``RULER_SPLITS`` (5)
  disjoint fit splits of ``RULER_N_FIT`` (20,000) sentences and scored on one common test set of ``RULER_N_TEST``
  (10,000): the gate's pool, rows and splits exactly (``ruler.ruler_pool``, ``SeedSequence([0, 33])``, layout
  ``RULER_N_TEST`` / ``RULER_SPLITS`` x ``RULER_N_FIT`` / ``RULER_N_CV``). Every compared checkpoint (and every
  baseline row) is read on the same splits; a checkpoint's primary read-out on split r is its mean accuracy over
  A/B/C there. Beside it: every other layer's probe (``hidden_states`` 0..L-1) and full fine-tuning of the encoder
  per task (the gate's settings: ``FINETUNE_EPOCHS``, ``FINETUNE_LR``, ``FINETUNE_BATCH``, seed
  ``FINETUNE_SEED`` + r), both on the first ``SECONDARY_SPLITS`` (2) fit splits, same test set, run after every
  primary read-out of the requested claims; they are reported, never part of a verdict.
- *Paired intervals with the split noise in them*: a contrast's per-seed, per-split differences ``D[s, r]`` (both
  checkpoints of seed s read on split r) give the estimate ``mean(D)`` and the two-way 95% interval
  ``mean(D) +- t(0.975, min(S, R) - 1) * sqrt(var_s(mean_r D) / S + var_r(mean_s D) / R)`` (``ddof`` 1; the
  seed-by-split interaction is counted twice, so the interval is conservative). The seed-level t interval of the
  per-seed means is reported beside it. The direction each claim predicts is the paper's; PASS needs the interval
  wholly on that side, FAIL is "not shown" (a ``reading`` says whether the interval includes 0 or lies on the
  opposite side); fewer than ``SEEDS_REQUIRED`` (4) compared seeds: undecided (not saturated); a seed still running:
  undecided (runs in progress).
- *Tier*: the saturated tier (KL-set KL <= ``SATURATED_KL``, upper end <= ``SATURATED_KL_UPPER``) is primary in
  every claim; v1's matched tier (KL <= ``MATCHED_KL_CEILING`` and within ``MATCHED_KL_TOLERANCE`` of each other /
  of the seed's lowest) is a sensitivity row, computed after the primary rows. A start that missed the margin
  (starts.json) leaves its seed out of that width.
- *Doses and rates read from pilots.json*, never from a probe: C1's dose (``c1_dose``) for every continued run; C2's
  rate per width (``c2_rate/hW``); C3's dropout (``c3_dropout``); C5's weight (``c5_weight``). A claim whose pilot
  is not finished is refused before any compute. Every continued run: v1's continued training (AdamW beta2
  ``CONTINUE_BETA2``, weight decay ``CONTINUE_WEIGHT_DECAY`` unless an arm says otherwise, warm-up
  ``CONTINUE_WARMUP``, batch ``BATCH_SIZE``, branches annealed ``ANNEAL_STEPS`` to lr 0), measured on v1's KL set
  and trace contexts (KL, Fisher trace; no v1 probe), ``SEEDS`` (five model seeds), from the starts of starts.json.
- **C1** (H64, rate ``C1_RATE``, C1's dose, ``C1_BRANCHES`` (5) branches evenly over it, as v1's 5 over 5,000
  steps): compared branches of a seed = its saturated ones if >= ``MIN_COMPARED_BRANCHES`` (3). PASS if
  Spearman(step, Fisher trace) < 0 among them in >= 4 of 5 seeds AND the last-minus-first compared branch's
  primary read-out has a two-way interval above 0. Beside: last branch minus start (the gate's contrast), the
  trace's fall start -> last, the dose's status (``under-dosed`` is reported with the measured fall).
- **C2** (widths ``WIDTHS``, each from its start at its piloted rate for C1's dose, one branch at the end; H64's is
  C1's run when its rate is ``C1_RATE``): sizes compared are those whose last branch is saturated in >= 4 seeds;
  the largest against the smallest of them over the seeds where both are saturated and within
  ``MATCHED_KL_TOLERANCE``: PASS if larger-minus-smaller primary read-out has a two-way interval above 0 AND
  larger-minus-smaller Fisher trace in the largest width's parameter space (``hf_flatbias.enlarge``) a seed-level
  interval below 0 (v1's ``C2_RULE``).
- **C3** (H64, ``C1_RATE``, C1's dose, one branch at the end): v1's four arms with the piloted dropout in place of
  0.1: ``adamw`` (dropout d, weight decay 0.01), ``adamw_plain`` (0, 0), each with SAM (rho ``C3_SAM_RHO``); if the
  pilot found no saturated dropout, only the two arms without dropout run. Compared seeds: every arm's branch
  saturated and all within ``MATCHED_KL_TOLERANCE``. PASS if the arm with the largest seed-mean Fisher trace has the
  lowest seed-mean primary read-out AND flattest-minus-sharpest has a two-way interval above 0 (v1's ``C3_RULE``).
- **C4** (no new run): each seed's H64 start against the **strongest** of ``C4_BASELINES`` per task (highest mean
  over the splits): ``lexical`` (one-hot word per position), ``lookup`` (the exact masked conditionals
  ``Pr(x_t | x_-t)`` per position, v1's row), ``lookup_lexical`` (both concatenated), ``unmasked_lookup`` (the
  lookup read on the unmasked sentence: at each position the one-hot of the word there scaled by its exact
  conditional ``Pr(x_t | x_-t)``, concatenated with ``lookup_lexical``: the only unmasked read-out the exact
  conditionals define, since the conditional of a visible word is the one-hot itself). PASS if model-minus-strongest
  has a two-way interval above 0 on >= ``C4_TASKS_REQUIRED`` (2) of 3 tasks over >= 4 saturated starts: beating
  the strongest per task beats them all. Beside: the mean over tasks, each baseline's own contrast, each seed's last
  C1 branch.
- **C5** (H64, ``C1_RATE``, C1's dose, v1's adversary on the evaluated read-out at the piloted weight, annealed with
  the same objective): its last branch against the same seed's last C1 branch, both saturated and within
  ``MATCHED_KL_TOLERANCE``: PASS if adversarial-minus-C1 primary read-out has a two-way interval below 0 (v1's
  ``C5_RULE``); the pilot found no saturated weight: not run, undecided (the adversary cannot stay saturated).
- **C6** (no new run): among a seed's compared C1 branches, the branch ``select_flattest_checkpoint`` picks (its
  defaults) against the lowest-KL branch: PASS if chosen-minus-lowest-KL primary read-out has a two-way interval
  above 0 over >= 4 seeds (a seed where both pick the same branch counts 0 on every split) (v1's ``C6_RULE``).

The ruler reads only the checkpoints a rule compares (each C1 seed's first and last compared branches, C6's two
picks, the starts; the last branches of C2, C3, C5), chosen from KL and trace alone before any probe is fitted.
Order: C1, C4, C6, C5, C2, C3 (``CLAIMS``); inside the phase, every training unit of the requested claims, then
their primary read-outs, then the secondary read-outs and the matched sensitivity rows.

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

# -- claims: the ruler read-out (the gate's, RULES.md) --
RULER_C = 0.3  # the gate's 3-fold cross-validated C (ruler_gate.json "cv"/"chosen"), fixed for every claim
RULER_N_FIT = 20_000
RULER_SPLITS = 5
RULER_N_TEST = 10_000
RULER_N_CV = 10_000  # the gate's CV rows: part of the pool's layout (so the same rows), unused by the claims
RULER_MAX_ITER = 1000
SECONDARY_SPLITS = 2  # every other layer's probe and the fine-tuning: on the first two fit splits
FINETUNE_EPOCHS = 3
FINETUNE_LR = 5e-4
FINETUNE_BATCH = 64
FINETUNE_SEED = 0

# -- claims: rules (v1's definitions, verdicts.C1_RULE .. C6_RULE, read by the ruler in the saturated tier) --
CLAIMS = ("C1", "C4", "C6", "C5", "C2", "C3")  # the order the phase runs them in
C1_BRANCHES = 5  # branches evenly over C1's dose (v1: 5 over 5,000 steps)
MIN_COMPARED_BRANCHES = 3
SEEDS_REQUIRED = 4
MATCHED_KL_CEILING = 0.020
MATCHED_KL_TOLERANCE = 0.003
CONFIDENCE = 0.95
C3_SAM_RHO = 0.05
C4_TASKS_REQUIRED = 2
C4_BASELINES = ("lexical", "lookup", "lookup_lexical", "unmasked_lookup")

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
    "C1_BRANCHES",
    "C1_RATE",
    "C3_SAM_RHO",
    "C4_BASELINES",
    "C4_TASKS_REQUIRED",
    "CLAIMS",
    "CONFIDENCE",
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
    "FINETUNE_BATCH",
    "FINETUNE_EPOCHS",
    "FINETUNE_LR",
    "FINETUNE_SEED",
    "FIRST_DECAY",
    "LAYERS",
    "LOST_SESSION",
    "MARGIN_KL",
    "MARGIN_KL_UPPER",
    "MATCHED_KL_CEILING",
    "MATCHED_KL_TOLERANCE",
    "MAX_EXTENSIONS",
    "MIN_COMPARED_BRANCHES",
    "PILOT_SEED",
    "RATE_LADDER",
    "RULER_C",
    "RULER_MAX_ITER",
    "RULER_N_CV",
    "RULER_N_FIT",
    "RULER_N_TEST",
    "RULER_SPLITS",
    "SATURATED_KL",
    "SATURATED_KL_UPPER",
    "SECONDARY_SPLITS",
    "SEEDS",
    "SEEDS_REQUIRED",
    "V1_WIDTH",
    "WIDTHS",
]
