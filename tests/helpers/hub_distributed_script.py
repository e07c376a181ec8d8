"""Run by `accelerate launch` with 2 processes from test_hub.py: train, save and push, recording who writes cards.

Usage: hub_distributed_script.py OUTPUT_DIR REPO_ID
"""

import os
import sys
from pathlib import Path

from test_modelcard import FixedTraceCallback, tiny_args, tiny_mlm_setup

import hf_flatbias.modelcard as modelcard
from hf_flatbias.trainer import FlatBiasTrainer


def main() -> None:
    output_dir, repo_id = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ.get("RANK", "0"))
    writes_log = output_dir.parent / f"card_writes.rank{rank}.txt"
    original_render = modelcard.FlatnessCard.render

    def recording_render(card):
        with open(writes_log, "a") as log:
            log.write(f"{card.global_step}\n")
        return original_render(card)

    modelcard.FlatnessCard.render = recording_render
    model, data = tiny_mlm_setup()
    args = tiny_args(
        output_dir,
        push_to_hub=True,
        hub_model_id=repo_id,
        hub_strategy="checkpoint",
        hub_always_push=True,
        per_device_train_batch_size=2,
    )
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=data, callbacks=[FixedTraceCallback(7.0)])
    trainer.train()
    trainer.push_to_hub()
    (output_dir.parent / f"done.rank{rank}").write_text(str(trainer.args.world_size))


if __name__ == "__main__":
    main()
