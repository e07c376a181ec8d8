"""A plain CPU run prints what the user asked for: no pin_memory warning, no DeepSpeed accelerator notice."""

import os
import subprocess
import sys

from tests.conftest import REPO

SCRIPT = """
from hf_flatbias import FlatBiasConfig, FlatBiasTrainer
from tests.helpers.tiny_models import classification_rows, tiny_classifier
args = FlatBiasConfig(output_dir={output!r}, max_steps=2, num_train_epochs=2, per_device_train_batch_size=4,
                      report_to="none", save_strategy="no", disable_tqdm=True, flatness_method="sam")
FlatBiasTrainer(model=tiny_classifier(), args=args, train_dataset=classification_rows(12)).train()
print("trained")
"""


def test_a_plain_cpu_run_has_no_pin_memory_or_deepspeed_notice(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(output=str(tmp_path))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "trained" in result.stdout
    assert "pin_memory" not in result.stderr
    assert "Setting accelerator to CPU" not in result.stderr
