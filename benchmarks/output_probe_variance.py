"""One-draw variance of ``per_sample`` with sampled labels against random signs at the logits (``output_probe``).

Both cotangents have the covariance ``diag(p) - p p^T`` (unbiased for the same Fisher trace, the same cost per draw);
what differs is the noise of a draw. Per model: the mean over contexts of the variance between one context's draws,
for each cotangent, with the output layer's own term in exact expectation (the default). Models: the 0.94M BERT of
`curvlinops_side_by_side.py` fitted to its 16 contexts, the trained paper-shaped PCFG BERTs whose weights the
repository holds (and random initialisations of their configurations), a random causal Llama, and the tests' toy.
CPU, one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/output_probe_variance.py

Last lines: ``variance_ratio[MODEL]=X`` (labels / signs: above 1, the signs are less noisy).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import build_model, masked_lm_rows  # noqa: E402
from spectrum_vs_pyhessian import fit  # noqa: E402
from transformers import BertForMaskedLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_flatbias.flatness import TraceContexts, build_masked_contexts, compute_trace_samples  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STARTS = {
    "H128 PCFG BERT (campaign v2 start, seed 0)": "recipes/research/results/campaign_v2/starts/h128/seed0/start",
    "H64 PCFG BERT (campaign v2 start, seed 0)": "recipes/research/results/campaign_v2/starts/h64/seed0/start",
    "H32 PCFG BERT (saturated start, seed 0)": (
        "recipes/research/results/saturated_start/campaign_state/seed0/h32/start"
    ),
}


def draw_variances(model, rows, draws: int, *, causal: bool) -> tuple[float, dict[str, float]]:
    """The trace (signs) and, per cotangent, the mean over contexts of the one-draw variance."""
    contexts = TraceContexts.from_rows(rows, causal=causal)
    variances, trace = {}, 0.0
    with evaluation_mode(model):
        for kind in ("label", "rademacher"):
            values = compute_trace_samples(
                model, contexts, n_draws=draws, batch_size=16, output_probe=kind, seed=1
            ).values
            variances[kind] = float(values.var(dim=1).mean())
            trace = float(values.mean())
    return trace, variances


def pcfg_rows(n: int) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from recipes.research.campaign import SHAPES
    from recipes.research.paper_language import setup_paper_language

    language = setup_paper_language(
        0, n_train=1, n_kl=1, n_trace=n, n_probe=4, shape=SHAPES["three_level"], with_conditionals=False
    )
    return [dict(row) for row in language.trace_contexts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=96)
    parser.add_argument("--contexts", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    models = []

    vocab, seq_len = 4000, 64
    bert = build_model(128, 2, vocab, seq_len, head_size=64).eval()
    tokens = masked_lm_rows(16, seq_len, vocab)
    fitted_rows = build_masked_contexts(
        [{"input_ids": row["input_ids"]} for row in tokens], mask_token_id=4, n_contexts=16, seed=0
    )
    fit(bert, TraceContexts.from_rows(fitted_rows, causal=False), 30)
    models.append(("0.94M BERT fitted 30 steps to its 16 contexts", bert, fitted_rows, False))

    rows = pcfg_rows(args.contexts)
    for name, path in STARTS.items():
        trained = BertForMaskedLM.from_pretrained(ROOT / path).eval()
        models.append((name, trained, rows, False))
        torch.manual_seed(0)
        models.append(
            (f"{name.split(' ')[0]} config, random init", BertForMaskedLM(trained.config).eval(), rows, False)
        )

    torch.manual_seed(0)
    llama_config = LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    llama = LlamaForCausalLM(llama_config).eval()
    ids = torch.randint(0, 1000, (16, 32), generator=torch.Generator().manual_seed(0))
    causal_rows = [
        {"input_ids": row.tolist(), "attention_mask": [1] * 32, "labels": [-100] * 31 + [int(row[-1])]} for row in ids
    ]
    models.append(("random Llama H128, vocabulary 1,000, last position", llama, causal_rows, True))

    sys.path.insert(0, str(ROOT))
    from tests.helpers.tiny_models import wide_masked_lm

    generator = torch.Generator().manual_seed(0)
    toy_rows = build_masked_contexts(
        [{"input_ids": torch.randint(2, 14, (8,), generator=generator).tolist()} for _ in range(16)],
        mask_token_id=1,
        seed=0,
    )
    models.append(("the tests' toy BERT (hidden 8, vocabulary 14)", wide_masked_lm(0, vocab_size=14), toy_rows, False))

    print(f"{args.draws} draws per context; CPU, {torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.1f}")
    print("| model | contexts | trace | one-draw variance, labels | random signs | labels / signs |")
    print("|---|---|---|---|---|---|")
    ratios = {}
    for name, model, model_rows, causal in models:
        trace, variances = draw_variances(model, model_rows, args.draws, causal=causal)
        ratios[name] = variances["label"] / variances["rademacher"]
        label, signs = variances["label"], variances["rademacher"]
        print(
            f"| {name} | {len(model_rows)} | {trace:.1f} | {label:.4g} | {signs:.4g} | {ratios[name]:.2f} |", flush=True
        )
    for name, ratio in ratios.items():
        print(f"variance_ratio[{name}]={ratio:.3g}")


if __name__ == "__main__":
    main()
