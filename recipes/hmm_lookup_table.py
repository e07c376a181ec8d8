"""Recipe 3 on the HMM language: the exact-conditional lookup table vs a trained transformer."""

from pcfg_lookup_table import main

from hf_flatbias.cli import run_recipe

if __name__ == "__main__":
    run_recipe(lambda argv: main(argv, default_language="hmm"))
