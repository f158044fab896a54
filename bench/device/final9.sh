#!/usr/bin/env bash
# On the GPU machine, after the model is carried: the speculation-policy load run through the gateway
# (the adaptive policy, plain decoding and three pinned trees in the same stack, same prompts), then a
# py-spy round profile of the three services with the fixed policy at concurrency 1, into $OUT.
set -uo pipefail
out=${OUT:-device-out}; mkdir -p "$out"
python3 -m pip install -q --no-deps .devcarry/b/wheels/py_spy-*.whl 2>/dev/null
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
timeout 330 python3 -m bench.services_bench --device cuda --ipc on --concurrency 1,4,16,64 --prompts 24 \
  --max-new-tokens 128 --requests-per-worker 3 --max-context 1024 \
  --modes spec,plain,tree:6x60,tree:4x16,tree:2x4 --out "$out" > "$out/policy.log" 2>&1
timeout 150 python3 -m bench.profile_services --out "$out/profile" --concurrency 1 --seconds 6 > "$out/profile.log" 2>&1
grep -E "tok/s total" "$out/policy.log"; head -3 "$out/profile/profile.md"
