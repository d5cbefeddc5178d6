#!/usr/bin/env bash
# GPU run 5 (issues 3, 5): DeepSpeed ZeRO-3 offload on the 3B job; layer speed compiled; 7B at 16k.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
export OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/layer_eff.py --preset qwen2.5-7b --tokens 8192 --compile 2>&1 | grep RESULT | tee $OUT/layer.txt
python3 bench/layer_eff.py --preset qwen2.5-7b --tokens 8192 2>&1 | grep RESULT | tee -a $OUT/layer.txt
python3 bench/train_shape.py --preset qwen2.5-7b --batch 8 --seq 2048 --micro 2 --steps 3 --opt-threads 14 2>&1 | tee $OUT/train7b_16k.txt
python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl
export PYTHONPATH=$PYTHONPATH:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .wheels/deepspeed-0.19.8.tar.gz
export CUDA_HOME=$(dirname $(dirname $(which nvcc)))
python3 bench/compare.py --preset qwen2.5-3b --tokens 8192 --systems deepspeed,gpu,megatrain --steps 4 2>&1 | tee $OUT/compare_run5.txt
