#!/usr/bin/env bash
# GPU run 6 (final): GPU tests; AdamW on huge pages; 3B at 8k and 32k and 7B at 16k and 64k
# with compiled layers; estimate vs measured on the same machine.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader; cat /sys/kernel/mm/transparent_hugepage/enabled
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
timeout 60 python3 bench/adamw_cpu.py --params 1e9 --block 80e6 --threads 14 --reps 2 2>&1 | grep RESULT | tee $OUT/adamw.txt
python3 bench/estimate_check.py --probe-out $OUT/hw.json > /dev/null 2>&1
T="python3 bench/train_shape.py --opt-threads 14 --compile"
timeout 110 $T --preset qwen2.5-3b --batch 4 --micro 1 --steps 4 > $OUT/m3b_8k.log 2>&1
timeout 110 $T --preset qwen2.5-3b --batch 16 --micro 4 --steps 4 > $OUT/m3b_32k.log 2>&1
timeout 30 python3 bench/peers.py --mode gpu --preset qwen2.5-3b --batch 4 --steps 4 2>&1 | grep RESULT | tee -a $OUT/results.jsonl
timeout 170 $T --preset qwen2.5-7b --batch 32 --micro 8 --steps 3 > $OUT/m7b_64k.log 2>&1
grep -h "step [0-9] loss" $OUT/m*.log | cut -c1-200
python3 bench/estimate_check.py $OUT/results.jsonl --hardware $OUT/hw.json | tee $OUT/estimate_check.md
grep -h "^RESULT" $OUT/*.log | cut -c1-330
