#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU: the vLLM engine + the torch and Megatron
# trainers on a small model for a few steps; prints throughput and the PD transfer rate.
# Installs nothing and downloads nothing: the environment must already hold vllm (CUDA
# build), torch with CUDA and, for the Megatron run, megatron-core. Usage:
#   benchmarks/gpu_check.sh [--model /local/hf/folder] [--quick] [extra gpu_check.py args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  || { echo "gpu_check: no NVIDIA GPU visible (nvidia-smi failed)"; exit 2; }
"$PY" - <<'PY' || { echo "gpu_check: environment incomplete (nothing is installed by this script)"; exit 2; }
import importlib.util, torch
assert torch.cuda.is_available(), "torch has no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for mod in ("vllm", "megatron.core", "transformer_engine"):
    print(mod, "found" if importlib.util.find_spec(mod) else "MISSING")
assert importlib.util.find_spec("vllm"), "vllm is required"
PY
# The trainer stays in the same process as the vLLM engine: keep vLLM's share of GPU memory small.
"$PY" benchmarks/gpu_check.py --device cuda --trainer torch "$@"
if "$PY" -c "import megatron.core" 2>/dev/null; then
  "$PY" benchmarks/gpu_check.py --device cuda --trainer megatron "$@"
else
  echo "gpu_check: megatron-core not installed: Megatron run skipped"
fi
# on a lent device machine only $OUT comes back: the run's records with it
if [ -n "${OUT:-}" ] && [ -f benchmarks/results/gpu_check.jsonl ]; then
  cp benchmarks/results/gpu_check.jsonl "$OUT/"
fi
