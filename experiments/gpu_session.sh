#!/usr/bin/env bash
# One device session's checks, run from the repository root on a lent GPU machine (its image has
# jax, optax, pandas, matplotlib and ml_dtypes; the package runs from the source tree):
#   bash experiments/gpu_session.sh OUT_DIR
# Writes OUT_DIR/layer-sum-gpu.md (experiments/bench_layer_sum.py on encoder_latency) and
# OUT_DIR/encoder_latency-gpu/ (a tune of it with the search's timing rule for GPUs).
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR}
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 260 python experiments/bench_layer_sum.py encoder_latency --repeats 9 --unroll 1 8 \
  --out "$out/layer-sum-gpu.md" 2>&1 | grep -Ev "Warning|warn\(" | tail -20
timeout 300 python -m autopolicy tune encoder_latency --out "$out/encoder_latency-gpu" --no-shared-cache \
  --no-progress 2>&1 | tail -12
