#!/usr/bin/env bash
# One device session's checks, run from the repository root on a lent GPU machine (its image has
# jax, optax, pandas, matplotlib and ml_dtypes; the package runs from the source tree):
#   bash benchmarks/gpu_session.sh OUT_DIR
# Writes OUT_DIR/encoder_latency-gpu/ (a tune with the search's timing rules for GPUs: its
# summary's latency_model scales near 1 mean layers timed alone add up to the model) and
# OUT_DIR/layer-sum-gpu.md (benchmarks/bench_layer_sum.py: the timing rules side by side).
# It measures the search's GPU timing rules against the whole model (the layers' sum over the
# model's time) and what a tune chooses there. The current figures: reports/gpu-session-nvidia-h200.md
# and reports/layer-sum-encoder_latency-nvidia-h200.md.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR}
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 300 python -m autopolicy tune encoder_latency --out "$out/encoder_latency-gpu" --no-shared-cache \
  --no-progress 2>&1 | grep -v "^  encoder/" | tail -12
timeout 200 python benchmarks/bench_layer_sum.py encoder_latency --repeats 9 --unroll 1 8 \
  --out "$out/layer-sum-gpu.md" 2>&1 | grep -Ev "Warning|warn\(" | tail -20
