"""Recipe 1 on the HMM language: continued training after convergence (see pcfg_continue_training.py)."""

from pcfg_continue_training import main

from hf_flatbias.cli import run_recipe

if __name__ == "__main__":
    run_recipe(lambda argv: main(argv, default_language="hmm"))
