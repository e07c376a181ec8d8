"""Recipe 2 on the HMM language: AdamW +-dropout/weight decay, +-SAM (see pcfg_optimizers.py)."""

from pcfg_optimizers import main

from hf_flatbias.cli import run_recipe

if __name__ == "__main__":
    run_recipe(lambda argv: main(argv, default_language="hmm"))
