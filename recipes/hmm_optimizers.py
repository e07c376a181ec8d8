"""Recipe 2 on the HMM language: AdamW +-dropout/weight decay, +-SAM (see pcfg_optimizers.py)."""

from pcfg_optimizers import main

if __name__ == "__main__":
    main(default_language="hmm")
