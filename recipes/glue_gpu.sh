#!/usr/bin/env bash
# Pre-train the paper's three settings with the released code's settings at a small BERT size on the offline corpus
# (BBC news), then compare them on GLUE (offline: the SST-2 stand-in; other tasks need --data_dir or the Hub).
# Sized for <= 10 minutes on one GPU; --smoke runs the same pipeline on CPU with tiny models in a few minutes.
#
#   recipes/glue_gpu.sh [--smoke] [OUTPUT_DIR]       # default OUTPUT_DIR: runs/glue_gpu (or runs/glue_gpu_smoke)
#
# Results: OUTPUT_DIR/compare/glue_compare.md (table), .csv, _paired.csv, .png; checkpoints in OUTPUT_DIR/<setting>.
set -euo pipefail

recipes="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
smoke=()
if [[ "${1:-}" == "--smoke" ]]; then
  smoke=(--smoke)
  shift
fi
output="${1:-runs/glue_gpu${smoke:+_smoke}}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export PYTHONPATH="$(dirname "$recipes")${PYTHONPATH:+:$PYTHONPATH}"

if [[ ${#smoke[@]} -eq 0 ]]; then
  # A 4-layer, 256-wide BERT (11M parameters with the 8k vocabulary), 2,000 steps of 128 x 128 tokens each.
  pretrain_size=(--model_size mini --max_steps 2000 --eval_steps 500 --save_steps 1000 --trace_every_n_steps 500)
  finetune=(--seeds 0 1 2 3 4 --num_train_epochs 2 --max_train_samples 4000 --learning_rate 0.0001
            --per_device_train_batch_size 32 --per_device_eval_batch_size 256)
else
  pretrain_size=()
  finetune=()
fi

declare -A settings=(
  [adamw_dropout_wd]="--dropout 0.1 --weight_decay 0.01"
  [no_dropout_no_wd]="--dropout 0 --weight_decay 0"
  [no_dropout_no_wd_sam]="--dropout 0 --weight_decay 0 --flatness_method sam --sam_rho 0.05"
)
start=$SECONDS
for setting in adamw_dropout_wd no_dropout_no_wd no_dropout_no_wd_sam; do
  # shellcheck disable=SC2086  # the setting's flags are meant to split
  python "$recipes/bert_bookcorpus.py" --config "$recipes/configs/released_code.yaml" "${smoke[@]}" \
    --dataset bbc_news --report_to none "${pretrain_size[@]}" ${settings[$setting]} --output_dir "$output/$setting"
  echo "glue_gpu: pre-trained $setting at $((SECONDS - start)) s" >&2
done

python "$recipes/glue_compare.py" "$output/adamw_dropout_wd" "$output/no_dropout_no_wd" \
  "$output/no_dropout_no_wd_sam" "${smoke[@]}" --tasks sst2,rte "${finetune[@]}" --output_dir "$output/compare"
echo "glue_gpu: done in $((SECONDS - start)) s; table in $output/compare/glue_compare.md" >&2
