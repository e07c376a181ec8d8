"""Recipe 1 on the HMM language: continued training after convergence (see pcfg_continue_training.py)."""

from pcfg_continue_training import main

if __name__ == "__main__":
    main(default_language="hmm")
