#!/usr/bin/env bash
# GPU run 6 (final): GPU tests; AdamW on huge pages; 7B at 16k (eager) and 64k (compiled
# layers); the estimate against the measurements of this machine.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader; cat /sys/kernel/mm/transparent_hugepage/enabled
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "not compiled" 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
timeout 60 python3 bench/adamw_cpu.py --params 1e9 --block 80e6 --threads 14 --reps 2 2>&1 | grep RESULT | tee $OUT/adamw.txt
timeout 40 python3 bench/estimate_check.py --probe-out $OUT/hw.json > /dev/null 2>&1
T="python3 bench/train_shape.py --opt-threads 14"
timeout 120 $T --preset qwen2.5-7b --batch 8 --micro 2 --steps 5 > $OUT/m7b_16k.log 2>&1
timeout 190 $T --preset qwen2.5-7b --batch 32 --micro 8 --steps 3 --compile > $OUT/m7b_64k.log 2>&1
grep -h "step [0-9] loss" $OUT/m*.log | cut -c1-220
python3 bench/estimate_check.py $OUT/results.jsonl --hardware $OUT/hw.json | tee $OUT/estimate_check.md
grep -h "^RESULT" $OUT/*.log | cut -c1-330
