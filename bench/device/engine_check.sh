#!/usr/bin/env bash
# On the GPU machine, after `source .devcarry/b/unpack.sh` (../shared/device/README.md): the Triton
# kernels against their reference, the engine-step probe on the real model, and the GPU tests.
# Results land in $OUT (or ./device-out).
set -uo pipefail
out=${OUT:-device-out}; mkdir -p "$out"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -20 | tee "$out/kernels.txt"
timeout 240 python3 -m bench.decode_probe --out "$out/probe" -v 2>&1 | tail -120 | tee "$out/probe.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -40 | tee "$out/gpu_tests.txt"
if [ "${BENCH:-0}" = 1 ]; then
  timeout 400 python3 -m bench.run --out "$out/bench" --prompts 16 --max-new-tokens 128 --concurrency 1,4,16 \
    --hf-prompts 2 2>&1 | tail -60 | tee "$out/bench.txt"
fi
