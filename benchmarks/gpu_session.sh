#!/usr/bin/env bash
# One device session's checks, run from the repository root on a lent GPU machine (its image has
# jax, optax, pandas, matplotlib and ml_dtypes; the package runs from the source tree):
#   bash benchmarks/gpu_session.sh OUT_DIR [kernels|timing]
# kernels (the default; every step under `timeout`, 560 s in all, so it fits 10 minutes on an H100
# or H200): the device, its versions and clocks; benchmarks/bench_gpu_kernels.py at its full shapes
# (the shapes not reached in its time budget are listed on its page), writing
# OUT_DIR/gpu-kernels-<gpu>.md (the page for reports/) and printing its HLO form verdicts; then
# tunes of bert_base and of decoder_1b at batch 1 and 64 (OUT_DIR/<experiment>-gpu/), each followed
# by its summary lines.
# timing: the search's GPU timing rules against the whole model: OUT_DIR/encoder_latency-gpu/ (a
# tune: its summary's latency_model scales near 1 mean layers timed alone add up to the model) and
# OUT_DIR/layer-sum-gpu.md (benchmarks/bench_layer_sum.py: the timing rules side by side); its
# figures: reports/gpu-session-nvidia-h200.md and reports/layer-sum-encoder_latency-nvidia-h200.md.
set -uo pipefail
out=${1:?usage: gpu_session.sh OUT_DIR [kernels|timing]}
session=${2:-kernels}
export PYTHONPATH=.
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,pstate,temperature.gpu \
  --format=csv
python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices(), \
'default matmul precision', jax.config.jax_default_matmul_precision)"
# limited SECONDS COMMAND...: the command under `timeout`, saying so when it ran out of time.
limited() {
  timeout "$1" "${@:2}"
  local status=$?
  if [ "$status" -eq 124 ]; then echo "gpu_session.sh: stopped at its limit of $1 s: ${*:2}"; fi
  return "$status"
}
# What a tune's output keeps: its summary lines (the device, the chosen map against float32, the
# workload, the time), errors, and a step stopped at its limit.
summary="^(device|chosen map|workload|time):|[Ee]rror|stopped at its limit"
case "$session" in
  kernels)
    limited 200 python benchmarks/bench_gpu_kernels.py --out "$out/" --rounds 5 --target-ms 10 --budget-s 150 \
      2>&1 | grep -Ev "Warning|warn\("
    limited 160 python -m autopolicy tune bert_base --out "$out/bert_base-gpu" --no-shared-cache --no-progress \
      2>&1 | grep -E "$summary"
    limited 100 python -m autopolicy tune decoder_1b --option batch=1 --out "$out/decoder_1b-b1-gpu" \
      --no-shared-cache --no-progress 2>&1 | grep -E "$summary"
    limited 100 python -m autopolicy tune decoder_1b --option batch=64 --out "$out/decoder_1b-b64-gpu" \
      --no-shared-cache --no-progress 2>&1 | grep -E "$summary"
    ;;
  timing)
    timeout 300 python -m autopolicy tune encoder_latency --out "$out/encoder_latency-gpu" --no-shared-cache \
      --no-progress 2>&1 | grep -v "^  encoder/" | tail -12
    timeout 200 python benchmarks/bench_layer_sum.py encoder_latency --repeats 9 --unroll 1 8 \
      --out "$out/layer-sum-gpu.md" 2>&1 | grep -Ev "Warning|warn\(" | tail -20
    ;;
  *)
    echo "gpu_session.sh: invalid session. Expected one of kernels, timing. Received: $session" >&2
    exit 2
    ;;
esac
