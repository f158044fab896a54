#!/usr/bin/env bash
# On the GPU machine, after `source .devcarry/b/unpack.sh` (../shared/device/README.md): the Triton
# kernels against their reference, the GPU tests, and either the engine-step probe (default) or, with
# BENCH=1, the whole `make bench` run (probe included) and a py-spy profile of the services' rounds.
# Keeps at most 8 files in $OUT.
set -uo pipefail
out=${OUT:-device-out}; work=/tmp/specdec-bench; mkdir -p "$out" "$work"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tail -3 >> "$out/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tail -30 >> "$out/gpu.txt"
if [ "${BENCH:-0}" = 1 ]; then
  timeout 420 python3 -m bench.run --out "$work" 2>&1 | tail -80 > "$out/bench.txt"
  cp "$work/summary.md" "$work/summary.json" "$work/decode_probe.md" "$out/" 2>/dev/null
  timeout 120 python3 -m bench.profile_services --out "$work/prof" --seconds 5 --colocate off > /dev/null 2>&1
  cp "$work/prof/profile.md" "$out/" 2>/dev/null
  tar czf "$out/raw.tgz" -C "$work" . 2>/dev/null
else
  timeout 240 python3 -m bench.decode_probe --out "$work" -v 2>&1 | tail -120 > "$out/probe.txt"
  cp "$work/decode_probe.json" "$work/decode_probe.md" "$out/"
fi
