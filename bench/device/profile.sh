#!/usr/bin/env bash
# On the GPU machine, after the model is carried: where a speculative round's time goes through the
# services (py-spy of the three processes under a closed loop at concurrency 1, the fixed policy), the
# bare per-call RPC overhead, then the speculation-policy load run (as policy.sh), into $OUT.
set -uo pipefail
out=${OUT:-device-out}; mkdir -p "$out"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
timeout 150 python3 -m bench.profile_services --out "$out/profile" --concurrency 1 --seconds 6 > "$out/profile.log" 2>&1
timeout 120 python3 -m bench.rpc_bench --n 200 --device cuda > "$out/rpc.log" 2>&1
timeout 300 python3 -m bench.services_bench --device cuda --ipc on --concurrency 1,4,16,64 --prompts 16 \
  --max-new-tokens 128 --requests-per-worker 2 --max-context 1024 \
  --modes spec,plain,tree:6x60,tree:4x16,tree:2x4 --out "$out" > "$out/policy.log" 2>&1
head -3 "$out/profile/profile.md"; tail -12 "$out/rpc.log"; grep -E "tok/s total" "$out/policy.log"
