#!/usr/bin/env bash
# GPU run 3 (issue 3): megatrain vs GPU-resident vs FSDP2 on the Qwen2.5-3B job.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/compare.py --preset qwen2.5-3b --tokens 8192,32768 --systems megatrain,gpu,fsdp2 \
  --peer-tokens 8192 --steps 4 2>&1 | tee $OUT/compare_run3.txt
