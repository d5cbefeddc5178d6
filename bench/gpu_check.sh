#!/usr/bin/env bash
# GPU run 1 (issue 2): bf16 verify on CUDA, a Qwen2.5-3B-shaped model for 5 steps, baseline.
set -u
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g;
  python3 -c 'import torch,transformers;print(torch.__version__,transformers.__version__)'; } 2>&1 | tee $OUT/env.txt
for m in llama qwen3_moe qwen3_5; do
  python3 -m megatrain.cli verify --model-type $m --tiny --dtype bf16 --device cuda 2>&1 | tee -a $OUT/verify.txt
done
python3 -m megatrain.cli verify --model-type llama --tiny --device cuda 2>&1 | tee -a $OUT/verify.txt
python3 bench/train_shape.py --preset qwen2.5-3b --batch 4 --seq 2048 --steps 5 2>&1 | tee $OUT/train3b.txt
python3 bench/train_shape.py --preset qwen2.5-3b --batch 4 --seq 2048 --steps 4 --max-grad-norm 1.0 2>&1 | tee $OUT/train3b_clip.txt
python3 bench/peers.py --mode gpu --preset qwen2.5-3b 2>&1 | tail -3 | tee $OUT/peer_gpu.txt
grep -h "^RESULT\|PASS\|FAIL" $OUT/*.txt
