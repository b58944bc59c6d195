#!/usr/bin/env bash
# Model speed on a lent GPU (the ~0.6B / ~1.1B configs, bf16 compute on fp32 master weights; target MFU >= 40%
# against the matmul peak measured in the same run; H200 reference: ~790 TFLOP/s bf16).
#
# The lent H200 machine has JAX with CUDA, flax, safetensors and tokenizers preinstalled and no network,
# so the checkout runs from source (bench_model.py puts the repo on sys.path); nothing is installed.
#   bash benchmarks/gpu_model_bench.sh                # the gpu suite; JSON to $OUT (the device tool's) or benchmarks/results
#   bash benchmarks/gpu_model_bench.sh --smoke ...    # the tiny smoke suite: same code path, runs on CPU in seconds
# Extra arguments go to benchmarks/bench_model.py (e.g. --only qwen3_1b --steps 20).
set -euo pipefail
cd "$(dirname "$0")/.."
suite=gpu
if [ "${1:-}" = "--smoke" ]; then suite=smoke; shift; fi
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
py="${PYTHON:-python3}"
out_dir="${OUT:-benchmarks/results}"
mkdir -p "$out_dir"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv || true
fi
"$py" -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
"$py" benchmarks/bench_model.py --suite "$suite" --out "$out_dir/model_$suite.json" "$@"
