#!/usr/bin/env bash
# On the GPU machine, after the model is carried: the GPU tests, then the speculation-policy load run
# through the gateway (the adaptive policy, plain decoding and three pinned trees, same stack, same
# prompts, concurrency 1, 4, 16, 64), into $OUT.
set -uo pipefail
out=${OUT:-device-out}; mkdir -p "$out"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu tests/gpu > "$out/gpu_tests.log" 2>&1
timeout 330 python3 -m bench.services_bench --device cuda --ipc on --concurrency 1,4,16,64 --prompts 16 \
  --max-new-tokens 128 --requests-per-worker 2 --max-context 1024 \
  --modes spec,plain,tree:6x60,tree:4x16,tree:2x4 --out "$out" > "$out/policy.log" 2>&1
cp /tmp/specdec-*/gateway.log "$out/" 2>/dev/null
tail -5 "$out/gpu_tests.log"; grep -E "tok/s total" "$out/policy.log"
