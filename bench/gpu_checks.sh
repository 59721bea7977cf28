#!/usr/bin/env bash
# The GPU checks of the real-sizes work, as one script for a machine with a CUDA device (run from the repository root):
#  1. the device-agreement tests (every quantization method, validation's logits and the greedy answers on CUDA against
#     the same work on the CPU);
#  2. real shapes on CUDA (bench/scale_table.py): Qwen3-1.7B with the default recipe's quantization (W8A8 SmoothQuant +
#     GPTQ, down_proj FP16) and Llama-3.1-8B at 8 layers, then all 32, INT4 group 128 (AWQ + GPTQ), each stage's wall time,
#     peak host and device memory. Edge-LLM's exporter and TensorRT are not used (not installable there): the runs stop at
#     validation of the quantized checkpoint, computed in torch on the GPU.
#     bash bench/gpu_checks.sh [OUT_DIR] [TOKENIZER_DIR] [SECONDS]
# Every log goes to OUT_DIR; SECONDS bounds the whole script (the last run is cut to fit).
set -uo pipefail
out=${1:-bench_runs/gpu}; tokenizer=${2:-}; budget=${3:-3600}
mkdir -p "$out"; started=$SECONDS
left() { echo $(( budget - (SECONDS - started) - 15 )); }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, onnxruntime; print('torch', torch.__version__, 'transformers', transformers.__version__, 'onnxruntime', onnxruntime.__version__)" | tee -a "$out/gpu.txt"
timeout "$(left)" python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/unit/transforms/test_compute_device.py tests/unit/transforms/test_walk.py 2>&1 | tail -40 | tee "$out/tests.txt"
scale() {  # NAME RECIPE WORDS...
  local name=$1 recipe=$2; shift 2
  timeout "$(left)" python3 bench/scale_table.py --shapes "$name" --measure "$name" --recipe "$recipe" ${tokenizer:+--tokenizer "$tokenizer"} \
    --with device=cuda export_onnx=off "$@" 2>&1 | tee "$out/$name-$recipe.txt"
  cp "bench_runs/scale/$name-$recipe/run.log" "$out/$name-$recipe.log" 2>/dev/null
}
scale qwen3-1.7b int8 quantize.hadamard_block=0 "quantize.float_linears=[down_proj]"
scale llama-3.1-8b-8l int4 quantize.group_size=128
scale llama-3.1-8b int4 quantize.group_size=128
echo "done in $(( SECONDS - started )) s" | tee -a "$out/gpu.txt"
