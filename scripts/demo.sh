#!/usr/bin/env bash
# The CPU demo, end to end on a fresh machine: set up .venv, build the tiny random Qwen3.5 model and
# the demo dataset (no download), train a few LoRA steps through `launcher run`, show the results.
#   bash scripts/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
if [ ! -f demo/model/config.json ]; then
    launcher demo-assets --out demo
fi
launcher run configs/demo_cpu.yaml
run_dir=$(ls -td outputs/runs/demo-cpu-* | head -n 1)
echo
echo "adapter:      $run_dir/output/adapter_model.safetensors"
echo "trainer log:  $run_dir/output/trainer_log.jsonl"
echo "run record:   $run_dir/status.json"
