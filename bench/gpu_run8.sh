#!/usr/bin/env bash
# GPU run 8 (issue 5): the estimate against 3B at 8k/32k and 7B at 16k (eager), current code.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
T="python3 bench/train_shape.py --opt-threads 14"
timeout 100 $T --preset qwen2.5-3b --batch 4 --micro 1 --steps 5 > $OUT/m3b_8k.log 2>&1
timeout 100 $T --preset qwen2.5-3b --batch 16 --micro 4 --steps 4 > $OUT/m3b_32k.log 2>&1
timeout 150 $T --preset qwen2.5-7b --batch 8 --micro 2 --steps 6 > $OUT/m7b_16k.log 2>&1
grep -h "step [0-9] loss" $OUT/m*.log | cut -c1-200
python3 bench/estimate_check.py $OUT/results.jsonl --hardware bench/hw_h200_run6.json | tee $OUT/estimate_check.md
