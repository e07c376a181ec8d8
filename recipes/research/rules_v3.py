"""Campaign v3's pre-registered rules (issue 55), as constants the code reads; the prose is
``recipes/research/results/campaign_v3/RULES.md``, committed with this file before any v3 read.

v3 trains nothing: it reads campaign v2's committed checkpoints again, with full fine-tuning as the primary read-out
and the last-layer probe as the second, and ranks every flatness measure the product ships against that read-out.
"""

from __future__ import annotations

__all__ = [
    "BUDGET_CPU_HOURS",
    "CONFIDENCE",
    "C1_FIRST_STEP",
    "C1_LAST_STEP",
    "C1_STEPS",
    "C2_SEEDS",
    "C3_ARMS",
    "C3_CONTRAST",
    "FINETUNE_SEED_BASE",
    "GATE_LADDER",
    "GATE_MAX_SD",
    "GATE_PAIR",
    "MEASURE_DIRECTION",
    "MEASURES",
    "MEASURE_SETTINGS",
    "MIN_GROUP_SIZE",
    "PERMUTATIONS",
    "BOOTSTRAPS",
    "READS_BUDGET_CPU_HOURS",
    "SEEDS",
    "SELECTION_WINDOW_NATS",
    "SPECTRUM_CONTEXTS",
    "STAGES",
    "SURVIVE_ALPHA",
]

# ---------------------------------------------------------------- what is read
SEEDS = (0, 1, 2, 3, 4)
C1_STEPS = (8000, 16000, 24000, 32000, 40000)  # v2's five C1 branches per seed; v2 compared all five in every seed
C1_FIRST_STEP, C1_LAST_STEP = C1_STEPS[0], C1_STEPS[-1]
C3_ARMS = ("adamw", "adamw_plain", "adamw_plain_sam", "adamw_sam")
C3_CONTRAST = ("adamw_plain_sam", "adamw_plain")  # (flatter arm, its arm without SAM): confirmatory contrast (b)
C2_SEEDS = (0, 1, 2, 3)  # the seeds with an H128 branch in v2 (seed 4's H128 start missed the margin)

# ---------------------------------------------------------------- the fine-tuning read-out
# v2's fine-tuning exactly (ruler.finetune_accuracy: AdamW lr 5e-4, weight decay 0.01, batch 64, 3 epochs, a linear
# head on the concatenated last layer), on the ruler's 5 fit splits of 20,000 rows. Fine-tuning seed j of split r is
# FINETUNE_SEED_BASE * (j + 1) + r: none is v2's (seed r), so no confirmatory read repeats the fine-tuning runs that
# suggested the hypothesis. Every fine-tuned model is scored on the test rows (10,000) and on the CV rows (10,000).
FINETUNE_SEED_BASE = 1000

# ---------------------------------------------------------------- the gate and its ladder
GATE_PAIR = (f"c1/seed0/step-{C1_FIRST_STEP}", f"c1/seed0/step-{C1_LAST_STEP}")
GATE_MAX_SD = 0.002  # s.d. over the 5 splits (ddof 1) of the pair's paired difference
# rungs tried in order: (fine-tuning seeds per split, scored rows); "test+cv" scores on 20,000 rows
GATE_LADDER = ((2, "test"), (4, "test"), (4, "test+cv"))

# ---------------------------------------------------------------- order of the reads and the budget
# Each stage's checkpoints are fine-tuned (at the gate's rung) before the next stage starts; the probe reads a
# stage lacks follow its fine-tuning. Reads stop when READS_BUDGET_CPU_HOURS of v3 reading are spent.
STAGES = (
    ("gate", "the gate's pair: seed 0's first and last C1 branches"),
    ("c1_pair", "contrast (a): the first and last C1 branches of seeds 1-4"),
    ("c3_pair", "contrast (b): C3's adamw_plain_sam and adamw_plain, seeds 0-4"),
    ("c1_rest", "contrast (c): C1's middle branches and the H64 starts"),
    ("c3_rest", "C3's adamw and adamw_sam arms (tournament, descriptive)"),
    ("c2", "C2's H128 branches and starts, seeds 0-3 (descriptive)"),
)
BUDGET_CPU_HOURS = 15.0
READS_BUDGET_CPU_HOURS = 13.0  # the rest is the tournament's measures

# ---------------------------------------------------------------- intervals
CONFIDENCE = 0.95

# ---------------------------------------------------------------- the measure tournament
MIN_GROUP_SIZE = 4  # within-seed groups: C1 per seed (start + 5 branches), C3 per seed (4 arms)
BOOTSTRAPS = 5000
PERMUTATIONS = 10000
SURVIVE_ALPHA = 0.05  # Holm, over the measures, per read-out
SELECTION_WINDOW_NATS = 0.01  # the selector's window above the seed's lowest KL
# name -> +1 when a larger value means sharper (predicted to transfer worse), -1 when it means flatter, 0 unstated
MEASURE_DIRECTION = {
    "fisher_trace": +1,
    "fisher_trace_median_of_means": +1,
    "hessian_trace": +1,
    "top_eigenvalue": +1,
    "spectral_density_tail": +1,
    "spectrum_power_law": 0,
    "sam_sharpness": +1,
    "critical_sharpness": +1,
    "relative_critical_sharpness": +1,
    "weight_noise": +1,
    "quantization_8bit": +1,
    "quantization_4bit": +1,
    "fisher_diagonal_norm": +1,
    "gradient_alignment": -1,
}
MEASURES = tuple(MEASURE_DIRECTION)
# every measure on the campaign's 1,000 trace contexts (v1's), seed 0, the same for every checkpoint
MEASURE_SETTINGS = {
    "n_contexts": 1000,
    "fisher_draws": 2,
    "hessian_trace_draws": 8,
    "median_of_means_groups": 10,
    "top_k": 8,
    "density_tail_fraction": 0.1,
    "sam_rho": 0.05,
    "critical_rtol": 1.0 / 16,
    "noise_sigma": 1e-3,
    "noise_draws": 16,
    "quantization_bits": (8, 4),
    "alignment_sources": "sentence type",
    "relative_critical_task": "A",
}
# Amendment 1 (RULES.md): the spectrum group (top eigenvalues, density, power law) on the first 100 contexts
SPECTRUM_CONTEXTS = 100
