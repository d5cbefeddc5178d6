#!/usr/bin/env bash
# GPU run 2: CPU AdamW throughput on the GPU host; qwen3_5 bf16 verify; 3B at 8k and 32k tokens.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
cat /sys/kernel/mm/transparent_hugepage/enabled; lscpu | grep -E "Model name|Thread|NUMA|^CPU\(s\)" 
python3 bench/adamw_cpu.py --params 1.5e9 --block 80e6 --threads 16,14,12,8 2>&1 | tee $OUT/adamw.txt
python3 -m megatrain.cli verify --model-type qwen3_5 --tiny --dtype bf16 --device cuda 2>&1 | tail -7 | tee $OUT/verify.txt
python3 bench/train_shape.py --preset qwen2.5-3b --batch 4 --seq 2048 --steps 5 --opt-threads 14 2>&1 | tee $OUT/train3b_8k.txt
python3 bench/train_shape.py --preset qwen2.5-3b --batch 16 --seq 2048 --micro 4 --steps 4 --opt-threads 14 2>&1 | tee $OUT/train3b_32k.txt
grep -h "^RESULT\|PASS\|FAIL" $OUT/*.txt | cut -c1-400
