#!/usr/bin/env bash
# The GPU check, ready for the day a GPU is lent: at most 8 minutes on one GPU.
#   1. the GPU attention path (cuDNN, dflash_jax/attention/cudnn.py) against the portable page walk
#   2. AR step and DFlash cycle milliseconds at the published shapes (Qwen3-8B + 5-layer block-16
#      drafter, random bfloat16 weights, batch 8, context 1024): python -m bench --published-shapes
#   3. those against the HBM roofline of the ideal bytes (weights once, K/V in use once)
#   4. cache-size scaling: tokens/s with a cache for 128- and 8192-token prompts (the demo pair)
# bash bench/device_check.sh --tiny runs the same end to end on a CPU with tiny shapes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/device_check}
mkdir -p "$OUT"
tiny=0
[[ "${1:-}" == "--tiny" ]] && tiny=1
# Each part's time limit keeps a GPU run inside the device budget. --tiny runs on a CPU, whose
# speed depends on what else runs there (the heavy tests on 2 busy cores): 4x the limits.
limit() { echo $(( $1 * (tiny ? 4 : 1) )); }
step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }
if [[ $tiny == 1 ]]; then
    shape_args=(--scale 0.05 --context 128 --batch-size 2 --split-rounds 2 --split-min-time 0.01)
    cache_args=(--cache-prompt-lens 128,512 --max-new-tokens 8 --repeats 1 --batch-size 2 --num-prompts 4)
    tiny_flag=(--tiny)
else
    shape_args=(--context 1024 --batch-size 8)
    cache_args=(--cache-prompt-lens 128,8192 --max-new-tokens 64 --repeats 2)
    tiny_flag=()
fi
python -c "import jax; print('jax', jax.__version__, jax.devices())"
step "1. attention path against the page walk"
timeout $(limit 120) python -m bench.device_check exactness "${tiny_flag[@]}"
step "2. published shapes: AR step and DFlash cycle"
timeout $(limit 240) python -m bench --published-shapes "${shape_args[@]}" --json "$OUT/published.json"
step "3. against the HBM roofline"
timeout $(limit 60) python -m bench.device_check roofline --json "$OUT/published.json"
step "4. cache-size scaling"
timeout $(limit 150) python -m bench --cache-scaling "${cache_args[@]}" --json "$OUT/cache-scaling.json"
step "done: figures in $OUT"
