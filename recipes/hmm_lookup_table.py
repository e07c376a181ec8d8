"""Recipe 3 on the HMM language: the exact-conditional lookup table vs a trained transformer."""

from pcfg_lookup_table import main

if __name__ == "__main__":
    main(default_language="hmm")
