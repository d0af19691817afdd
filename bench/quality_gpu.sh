#!/usr/bin/env bash
# The quality profile's figures on a CUDA machine, in a few minutes: MLX's CUDA build in
# place of the CPU one, the models prepared (from a copied cache if there is one), then
# the LLM speed, the voices and speech-to-text, answer quality and tool calls.
#
#     bench/quality_gpu.sh [OUT_DIR]      # from the repository root, after the install
#
# Each bench writes its JSON into OUT_DIR (default: bench/gpu-results).
set -euo pipefail
out=${1:-bench/gpu-results}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}

"$py" -m pip install -q "mlx[cuda12]"
"$py" -c "import mlx.core as mx; print('mlx device:', mx.default_device())"
"$py" -m gateway.cli models prepare qwen2.5-coder-1.5b-instruct whisper-base kokoro-82m

"$py" bench/llm.py --model qwen2.5-coder-1.5b-instruct --shared-cache --rounds 2 \
    --max-tokens 48 --json > "$out/llm_qwen15.json"
"$py" bench/speech_quality.py --json > "$out/speech_quality.json"
"$py" bench/quality.py --json --profile default --profile quality > "$out/quality.json"
"$py" bench/tools.py --json --config configs/quality.yaml > "$out/tools_quality.json"
echo "figures in $out"
