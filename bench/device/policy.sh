#!/usr/bin/env bash
# On the GPU machine, after the model is carried (.devcarry, see README "On a GPU"): the speculation
# policy's runs, into $OUT.
#   bench/device/policy.sh load    the adaptive policy, plain decoding and three pinned trees, same stack,
#                                  same prompts, concurrency 1, 4, 16, 64 (PROMPTS, PER_WORKER: 24, 3),
#                                  then a py-spy round profile of the fixed policy at concurrency 1
#   bench/device/policy.sh order   plain and policy requests alternated twice at concurrency 16 and 64
#   bench/device/policy.sh rpc     the bare per-call RPC overhead (bench.rpc_bench)
#   bench/device/policy.sh tests   the GPU tests
#   bench/device/policy.sh chain   the GPU tests, then the round protocol A/B: the verifier chaining the draft
#                                  (on) against the gateway proposing every tree (off), one stack each,
#                                  6x60 pinned, plain and the policy at concurrency 1, 16, 64
#   bench/device/policy.sh stall   a 2,000-token prompt joining 16 running streams, whole and in 512- and
#                                  256-token chunks (bench.prefill_stall)
#   bench/device/policy.sh bench   one 10-minute call: the GPU tests (SKIP_TESTS=1: none), then `make bench` (bench.run) on 32
#                                  prompts (decode probe, engine bench, services at concurrency 1, 16, 64)
#   bench/device/policy.sh profile the GPU services test, then py-spy round profiles (fixed policy, 6x60)
#                                  at concurrency 1 and 64
#   bench/device/policy.sh sampling the two sampling rules' acceptance (bench.sampling_accept), 48 prompts
#   bench/device/policy.sh kernels the Triton kernels against their reference on CUDA (tests/test_kernels.py), the
#                                  decode probe with every step's kernels by device time, then the GPU tests
#                                  (SKIP_TESTS=1: none)
#   bench/device/policy.sh colocate the GPU services test, then the draft in the verifier's process (--draft-here)
#                                  against two processes, 6x60 pinned, the policy and plain at concurrency 1,
#                                  16, 64, in the order off, on, off
#   bench/device/policy.sh groups  services 6x60 pinned and the policy at concurrency 16 and 64 with one round
#                                  group and with two, alternated twice (one stack per run)
#   bench/device/policy.sh magpie  issue 11's Magpie prompts (training.pipeline prompts --magpie), resumed from
#                                  .devcarry/magpie.tgz when carried, the shards back as magpie.tgz
#   bench/device/policy.sh split   issue 8's colocated figure: the engine in process (plain, speculative), then the
#                                  services 6x60 pinned and the policy at concurrency 1, 16, 64, the draft in
#                                  two processes and in the verifier's (--draft-here), 1 and 4 rounds per Verify
#                                  (as run in session 10 it also ran the colocated stack at 8 and gave the
#                                  engine 150 s, which a fresh machine spent compiling)
#   bench/device/policy.sh split2  py-spy round profiles at concurrency 1, 6x60: two processes at 4 rounds per
#                                  Verify, the draft in the verifier's process at 4 and at 1, then the engine
#                                  in process (the baseline); the profiles back as spy.tgz
#   bench/device/policy.sh fixcheck session 10's K/V offset fix on the GPU (its test in tests/gpu), then the long
#                                  prompt under load at --max-context 4096 (bench.prefill_stall, whole and 512)
#   bench/device/policy.sh handover session 11's hand-over to the draft in the verifier's process: the engine in
#                                  process, then the colocated services at 1, the default (4) and 8 rounds per
#                                  Verify, 6x60 pinned, the policy and plain at concurrency 1, 16, 64
#   bench/device/policy.sh profile4 py-spy round profiles of the draft in the verifier's process at 4 rounds per
#                                  Verify, concurrency 1 and 64 (fixed policy, default tree); back as spy.tgz
#   bench/device/policy.sh queued  session 12's queued calls: the engine in process, then the colocated services at
#                                  the default rounds per Verify with one call at a time and with the next one
#                                  queued (--queue-calls off,on), 6x60 pinned and plain at concurrency 1, 16, 64
#   bench/device/policy.sh closed  the split under one workload: the engine in process in waves and in the services
#                                  bench's closed loop (--methods spec,closed), then the colocated services,
#                                  one call at a time and queued, 2 and the default 4 rounds per Verify, 6x60
#                                  pinned, concurrency 1, 16, 64, 4 requests per worker (PER_WORKER)
#   bench/device/policy.sh join    session 13's joiner path: the engine in process (plain, waves, closed loop), then the
#                                  colocated services at their defaults (queued calls, 4 rounds per Verify), 6x60
#                                  pinned and plain, concurrency 1, 16, 64, 4 requests per worker (PER_WORKER)
#   bench/device/policy.sh cut     session 14's A/B: this tree's colocated services (defaults) and OLD's (a folder holding an
#                                  older tree's common, services, bench and protos: `git archive C ... | tar x -C
#                                  .devcarry/old`) alternated new, old, new, old, 6x60 pinned, concurrency 1, 16, 64,
#                                  4 requests per worker (PER_WORKER), then the engine's closed loop
#   bench/device/policy.sh diag    session 15's round breakdown: the engine's closed loop, then this tree's colocated
#                                  services (defaults), 6x60 pinned, concurrency 1, 16, 64, 4 requests per worker,
#                                  their breakdown with the verifier's own work and idle time, then py-spy
#                                  profiles of the three processes at concurrency 16 (back as spy16.tgz)
#   bench/device/policy.sh ab15    session 15's A/B: the engine's closed loop (SKIP_ENGINE=1: none), then this tree's
#                                  colocated services (defaults; RUNS NAME-new8: 8 rounds per Verify), OLD's and MID's
#                                  (NAME-old, NAME-mid: two older trees unpacked as OLD is), RUNS
#                                  in order (default new, old, old, new), 6x60 pinned, concurrency 1, 16, 64,
#                                  PER_WORKER (8) requests per worker; GCPROBE=1: bench/gcprobe in every stack (the
#                                  collector's pauses per load window, gc-RUN.txt); ENGINE_AFTER=1: the engine's
#                                  closed loop again after the stacks (engine-after.log: its own spread)
#   bench/device/policy.sh ratio   session 19: issue 8's headline ratio with the engine in process and the colocated
#                                  services taking turns in one run (bench.split_ratio), REPS windows each
#   bench/device/policy.sh chainab session 20: the engine's closed loop with the device chain (this tree) and without
#                                  (OLD, default .devcarry/old), alternated new, old, old, new (RUNS)
#   bench/device/policy.sh place   session 19: the colocated services with the engine process on CPUs of its own
#                                  (ENGINE_CPUS, default 2,4; the gateway and the client off them and off their
#                                  measured siblings: bench.cpu_siblings) against the OS's placement, alternated,
#                                  then the engine's closed loop both ways
#   bench/device/policy.sh codefault session 21: is the draft in the verifier's process the better GPU default? The
#                                  stack's defaults (the adaptive policy), plain and 6x60 pinned, three processes against the
#                                  draft in the verifier's process (--colocate off,on), c=1, 16, 64, PER_WORKER (4),
#                                  then ghz by reflection against the colocated stack (bench.ghz_load --colocate)
#   bench/device/policy.sh probe   ghz by reflection against the stack's GPU default (colocated, bench.ghz_load), then the
#                                  colocated services, the policy, plain and 6x60 pinned, c=1, 16, 64, PER_WORKER (4).
#                                  Session 21's run 7 ran it with a first policy patch (9-probeab's diff with a window
#                                  of 15, one-choice probes and no doubling; reverted)
#   bench/device/policy.sh probeab this tree against OLD (default .devcarry/old, its models linked from here): ghz by
#                                  reflection (bench.ghz_load, the stack's defaults), new then old, then the colocated
#                                  services' policy (spec) at c=16 and 64, new then old. Session 21 ran it with a policy
#                                  patch applied (docs/results/h200-2026-11-26-s21/9-probeab/policy-probe.diff; reverted)
#   bench/device/policy.sh stallghz the 2,000-token prompt joining 16 running streams, whole and in 512-token chunks
#                                  (bench.prefill_stall), then ghz by reflection (GHZ: the binary) at concurrency 1,
#                                  16, 64 (bench.ghz_load)
#   (split3, overlap and loop, the modes of the --draft-thread and --engine-thread experiments, went with those
#   flags in session 16; their results stay in docs/benchmarks.md)
#   bench/device/policy.sh poll    session 16's A/B: the engine in process (plain, waves, closed loop), then the
#                                  colocated services at their defaults (the event loop answers other calls while
#                                  the device works) and with --block-on-device (it waits in the calls, as before),
#                                  RUNS in order (default 1-poll 2-block 3-block 4-poll), 6x60 pinned and plain,
#                                  c=1, 16, 64, PER_WORKER (8) requests per worker
#   bench/device/policy.sh stallab the 2,000-token prompt joining 16 running streams (bench.prefill_stall) with this
#                                  tree, STALL_RUNS (--prefill-chunk: 512,0,512 = in 512-token chunks, whole, chunked
#                                  again), then, when OLD names a folder holding an older tree (unpacked as for
#                                  `cut`), chunked and whole with that tree
#   bench/device/policy.sh final   session 17's figures for issue 8, one call: the engine in process (plain, waves, closed
#                                  loop), then the colocated services at their defaults twice, 6x60 pinned, plain and the
#                                  policy, c=1, 16, 64, PER_WORKER (8) requests per worker
#   bench/device/policy.sh pin     the colocated services (defaults) with the engine process on the OS's CPUs and pinned to
#                                  CPUS (3: --engine-cpus), alternated free, pin, pin, free, 6x60 pinned, c=1 and 16
#   bench/device/policy.sh stallwhy the long prompt in 512-token chunks (STALL_RUNS), a stack each, three processes
#                                  then the draft in the verifier's process, with the gateway's metrics read every
#                                  50 ms around it (bench.prefill_stall's trace: where the stall's time goes)
#   bench/device/policy.sh lanes   session 16's round groups on a Verify stream each: the engine's closed loop, then the
#                                  colocated services (defaults) with --round-groups 1 and 2, alternated one, two,
#                                  two, one, 6x60 pinned and the policy, c=16 and 64, PER_WORKER (8)
#   bench/device/policy.sh stalldiag the long prompt in 512-token chunks, speculative, on three stacks one after the
#                                  other (bench.prefill_stall), then the warnings and errors of every stack's
#                                  services (their logs stay in /tmp/specdec-*), then the GPU engine tests
#   bench/device/policy.sh rest    one 10-minute call: the chained/unchained A/B (6x60 pinned and plain,
#                                  concurrency 1, 16, 64), the long prompt (whole, 512-token chunks) and
#                                  ghz by reflection (GHZ: the binary, concurrency 1 and 64)
#   bench/device/policy.sh early   session 18's early answers (--early-answers): the engine in process (plain, closed
#                                  loop), then the colocated services (defaults) with early answers off and on, a
#                                  stack each, 6x60 pinned and the policy, c=1, 16, 64, PER_WORKER (8)
#   bench/device/policy.sh early2  the same A/B in the other order (on, off), then the colocated services with early
#                                  answers and 8 rounds per Verify (--rounds-per-call 8), 6x60 pinned, c=1, 16, 64
#   bench/device/policy.sh early3  early answers off and on alternated on four stacks (off, on, on, off), the colocated
#                                  services (defaults), 6x60 pinned, c=1, 16, 64, PER_WORKER (8)
#   bench/device/policy.sh between the engine's closed loop, then the colocated services (defaults) with the verifier's
#                                  Prefill beside the rounds (off) and between their calls (on: --prefill-between),
#                                  alternated ORDER (off, on, on, off), 6x60 pinned, c=1, 16, 64, PER_WORKER (8)
set -uo pipefail
mode=${1:-load}; root=$PWD
out=${OUT:-device-out}; mkdir -p "$out"
python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/gpu.txt"
{ nvidia-smi topo -m; lscpu | grep -E "Model name|^CPU\(s\)|NUMA|MHz|per core|per socket"
  echo "thread siblings: $(cat /sys/devices/system/cpu/cpu*/topology/thread_siblings_list 2>/dev/null | tr '\n' ' ')"
} >> "$out/gpu.txt" 2>&1  # which machine (session 17: machines differ)
# the GPU's clocks, temperature, power and throttle reasons every 2 s while the mode runs (session 18: successive
# stacks in one call ran slower and slower; is it the GPU?)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active \
  --format=csv -l 2 > "$out/clocks.csv" 2>&1 &
sampler=$!; trap 'kill $sampler 2>/dev/null' EXIT
load=(python3 -m bench.services_bench --device cuda --ipc on --max-new-tokens 128 --max-context 1024 --colocate off --out "$out")
engine() {  # the in-process baseline (plain, speculative) of the split modes; first on a fresh machine, it fills the
            # kernel cache that a colocated start would fill one engine at a time (150 s was not enough there)
  timeout 240 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 --concurrency 1,16,64 \
    --methods plain,spec --out /tmp/engine-bench > "$out/engine.log" 2>&1
  cp /tmp/engine-bench/engine_bench.json "$out/" 2>/dev/null; tail -10 "$out/engine.log" | head -8
}
closed_engine() {  # closed_engine NAME SECONDS [PREFIX...]: the engine's closed loop (6x60, c=1, 16, 64, PER_WORKER
                  # requests per worker) into $out/NAME.log and $out/NAME.json, under an optional command prefix
  local name=$1 seconds=$2; shift 2
  timeout "$seconds" "$@" python3 -m bench.engine_bench --device cuda --head "$root/models/eagle3-smollm2" --prompts 32 \
    --concurrency 1,16,64 --methods closed --requests-per-worker "${PER_WORKER:-8}" --out "/tmp/$name" > "$out/$name.log" 2>&1
  cp "/tmp/$name/engine_bench.json" "$out/$name.json" 2>/dev/null; grep -E "^speculative" "$out/$name.log"
}
case "$mode" in
  load)
    timeout 330 "${load[@]}" --concurrency 1,4,16,64 --prompts "${PROMPTS:-24}" \
      --requests-per-worker "${PER_WORKER:-3}" --modes spec,plain,tree:6x60,tree:4x16,tree:2x4 > "$out/policy.log" 2>&1
    python3 -m pip install -q --no-deps .devcarry/b/wheels/py_spy-*.whl 2>/dev/null
    timeout 150 python3 -m bench.profile_services --out "$out/profile" --concurrency 1 --seconds 6 --colocate off > "$out/profile.log" 2>&1
    grep -E "tok/s total" "$out/policy.log"; python3 -m bench.policy_table "$out/services.json" ;;
  order)
    timeout 240 "${load[@]}" --concurrency 16,64 --prompts 24 --requests-per-worker 4 \
      --modes plain,spec,plain,spec > "$out/order.log" 2>&1
    grep -E "tok/s total" "$out/order.log" ;;
  rpc)
    timeout 120 python3 -m bench.rpc_bench --n 200 --device cuda > "$out/rpc.log" 2>&1; tail -10 "$out/rpc.log" ;;
  tests)
    # 570: the compiled TTT train-step test compiles the attention with the rest (about 2 minutes, session 13)
    timeout 570 python3 -m pytest -q -m gpu tests/gpu > "$out/gpu_tests.log" 2>&1; tail -5 "$out/gpu_tests.log" ;;
  chain)
    timeout 150 python3 -m pytest -q -m gpu tests/gpu > "$out/gpu_tests.log" 2>&1; tail -3 "$out/gpu_tests.log"
    timeout 420 "${load[@]}" --concurrency 1,16,64 --prompts 16 --requests-per-worker 2 --chain on,off \
      --modes tree:6x60,plain,spec > "$out/chain.log" 2>&1
    grep -E "tok/s total" "$out/chain.log" ;;
  stall)
    timeout 500 python3 -m bench.prefill_stall --device cuda --concurrency 16 --prompt-tokens 2000 --colocate off \
      --prefill-chunk 0,512,256 --out "$out" > "$out/stall.log" 2>&1; tail -8 "$out/stall.log" ;;
  kernels)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernel_count.py \
      > "$out/kernel_tests.log" 2>&1; tail -3 "$out/kernel_tests.log"
    timeout 150 python3 -m bench.decode_probe --out "$out" -v > "$out/probe.log" 2>&1; cat "$out/decode_probe.md"
    [ -n "${SKIP_TESTS:-}" ] || timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1
    tail -3 "$out/gpu_tests.log" 2>/dev/null ;;
  bench)
    [ -n "${SKIP_TESTS:-}" ] || timeout 450 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gpu_tests.log" 2>&1
    tail -3 "$out/gpu_tests.log" 2>/dev/null; work=/tmp/specdec-bench; mkdir -p "$work"
    timeout 280 python3 -m bench.run --out "$work" --prompts 32 --hf-prompts 2 > "$out/bench.log" 2>&1
    cp "$work"/{summary.md,summary.json,decode_probe.md,services.json,engine_bench.json} "$out/" 2>/dev/null
    tail -25 "$out/bench.log" ;;
  rest)
    timeout 220 "${load[@]}" --concurrency 1,16,64 --prompts 16 --requests-per-worker 2 --chain on,off \
      --modes tree:6x60,plain > "$out/chain.log" 2>&1; grep -E "tok/s total" "$out/chain.log"
    timeout 190 python3 -m bench.prefill_stall --device cuda --concurrency 16 --prompt-tokens 2000 --colocate off \
      --prefill-chunk 0,512 --out "$out" > "$out/stall.log" 2>&1; tail -6 "$out/stall.log"
    if [ -n "${GHZ:-}" ]; then
      timeout 150 python3 -m bench.ghz_load --ghz "$GHZ" --concurrency 1,64 --requests-per-worker 2 --colocate off \
        --out /tmp/specdec-ghz > "$out/ghz.txt" 2>&1; cp /tmp/specdec-ghz/ghz.md "$out/" 2>/dev/null; tail -8 "$out/ghz.txt"
    fi ;;
  split)
    engine
    timeout 330 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 --requests-per-worker 2 \
      --modes tree:6x60,spec --colocate off,on --rounds-per-call 1,4 --out "$out/split" > "$out/split.log" 2>&1
    grep -hE "tok/s total" "$out/split.log" | sed 's/.*services_bench INFO //' | cut -c1-200 ;;
  split2)
    python3 -m pip install -q --no-deps --target /tmp/pyspy .devcarry/b/wheels/py_spy-*.whl; export PATH="/tmp/pyspy/bin:$PATH"
    for run in "off 4" "on 4" "on 1"; do  # off first: it fills the kernel cache (see split)
      set -- $run; extra=(--colocate "$1")
      timeout 150 python3 -m bench.profile_services --out "/tmp/prof-$1-$2" --concurrency 1 --seconds 6 \
        --rounds-per-call "$2" "${extra[@]}" > "$out/profile-$1-$2.log" 2>&1
      echo "colocate $1, k$2:"; sed -n 3p "/tmp/prof-$1-$2/profile.md"
    done
    tar czf "$out/spy.tgz" -C /tmp prof-off-4 prof-on-4 prof-on-1
    engine ;;
  handover)
    engine
    timeout 300 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 --requests-per-worker 2 \
      --modes tree:6x60,spec,plain --colocate on --rounds-per-call 1,0,8 --out "$out/handover" > "$out/handover.log" 2>&1
    grep -hE "tok/s total" "$out/handover.log" | sed 's/.*services_bench INFO //' | cut -c1-120 ;;
  queued)
    engine
    timeout 300 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 --requests-per-worker 2 \
      --modes tree:6x60,plain --colocate on --queue-calls off,on --out "$out/queued" > "$out/queued.log" 2>&1
    grep -hE "tok/s total" "$out/queued.log" | sed 's/.*services_bench INFO //' | cut -c1-150 ;;
  closed)
    timeout 240 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 \
      --concurrency 1,16,64 --methods spec,closed --requests-per-worker "${PER_WORKER:-4}" --out /tmp/engine-closed \
      > "$out/engine.log" 2>&1
    cp /tmp/engine-closed/engine_bench.json "$out/" 2>/dev/null; grep -E "^speculative" "$out/engine.log"
    timeout 330 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 \
      --requests-per-worker "${PER_WORKER:-4}" --modes tree:6x60 --colocate on --rounds-per-call 2,0 \
      --queue-calls off,on --out "$out/closed" > "$out/closed.log" 2>&1
    grep -hE "tok/s total" "$out/closed.log" | sed 's/.*services_bench INFO //' | cut -c1-150 ;;
  final)
    pw=${PER_WORKER:-8}
    timeout 240 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 \
      --concurrency 1,16,64 --methods plain,spec,closed --requests-per-worker "$pw" --out /tmp/engine-final \
      > "$out/engine.log" 2>&1
    cp /tmp/engine-final/engine_bench.json "$out/"; grep -E "^(speculative|plain)" "$out/engine.log"
    for run in 1 2; do
      timeout 170 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 --requests-per-worker "$pw" \
        --modes tree:6x60,plain,spec --colocate on --out "/tmp/final-$run" > "$out/final-$run.log" 2>&1
      cp "/tmp/final-$run/services.json" "$out/final-$run.json"; echo "run $run"; grep -hE "tok/s total" "$out/final-$run.log" | sed 's/.*services_bench INFO //' | cut -c1-420
    done ;;
  between)
    timeout 220 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 \
      --concurrency 1,16,64 --methods closed --requests-per-worker "${PER_WORKER:-8}" --out /tmp/engine-between \
      > "$out/engine.log" 2>&1
    cp /tmp/engine-between/engine_bench.json "$out/"; grep -E "^(speculative|plain)" "$out/engine.log"
    timeout 420 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 \
      --requests-per-worker "${PER_WORKER:-8}" --colocate on --modes tree:6x60 --prefill-between "${ORDER:-off,on,on,off}" \
      --out /tmp/between > "$out/between.log" 2>&1
    cp /tmp/between/services.json "$out/between.json"
    grep -hE "tok/s total" "$out/between.log" | sed 's/.*services_bench INFO //' | cut -c1-300 ;;
  early3)
    timeout 450 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 \
      --requests-per-worker "${PER_WORKER:-8}" --colocate on --modes tree:6x60 --early-answers off,on,on,off \
      --out /tmp/early3 > "$out/early3.log" 2>&1
    cp /tmp/early3/services.json "$out/early3.json"
    grep -hE "tok/s total" "$out/early3.log" | sed 's/.*services_bench INFO //' | cut -c1-300 ;;
  early|early2)
    pw=${PER_WORKER:-8}
    if [ "$mode" = early ]; then
      timeout 200 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 \
        --concurrency 1,16,64 --methods plain,closed --requests-per-worker "$pw" --out /tmp/engine-early \
        > "$out/engine.log" 2>&1
      cp /tmp/engine-early/engine_bench.json "$out/"; grep -E "^(speculative|plain)" "$out/engine.log"
      orders=(off,on)
    else
      orders=(on,off)
    fi
    ab=(--head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 --requests-per-worker "$pw" --colocate on)
    for order in "${orders[@]}"; do
      timeout 250 "${load[@]}" "${ab[@]}" --modes tree:6x60,spec --early-answers "$order" --out "/tmp/early-$order" \
        > "$out/early-${order/,/-}.log" 2>&1
      cp "/tmp/early-$order/services.json" "$out/early-${order/,/-}.json"; echo "$order"
      grep -hE "tok/s total" "$out/early-${order/,/-}.log" | sed 's/.*services_bench INFO //' | cut -c1-300
    done
    if [ "$mode" = early2 ]; then
      timeout 150 "${load[@]}" "${ab[@]}" --modes tree:6x60 --rounds-per-call 8 --out /tmp/early-k8 \
        > "$out/early-k8.log" 2>&1
      cp /tmp/early-k8/services.json "$out/early-k8.json"; echo k8
      grep -hE "tok/s total" "$out/early-k8.log" | sed 's/.*services_bench INFO //' | cut -c1-300
    fi ;;
  pin)
    for run in 1-free 2-pin 3-pin 4-free; do
      cpus=(); [ "${run#*-}" = pin ] && cpus=(--engine-cpus "${CPUS:-3}")
      timeout 120 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16 --prompts 32 --requests-per-worker 8 \
        --modes tree:6x60 --colocate on "${cpus[@]}" --out "/tmp/pin-$run" > "$out/pin-$run.log" 2>&1
      echo "$run"; grep -hE "tok/s total" "$out/pin-$run.log" | sed 's/.*services_bench INFO //' | cut -c1-400
    done ;;
  join)
    timeout 270 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 \
      --concurrency 1,16,64 --methods plain,spec,closed --requests-per-worker "${PER_WORKER:-4}" --out /tmp/engine-join \
      > "$out/engine.log" 2>&1
    cp /tmp/engine-join/engine_bench.json "$out/" 2>/dev/null; grep -E "^(speculative|plain)" "$out/engine.log"
    timeout 300 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 \
      --requests-per-worker "${PER_WORKER:-4}" --modes tree:6x60,plain --colocate on --out "$out/join" > "$out/join.log" 2>&1
    grep -hE "tok/s total" "$out/join.log" | sed 's/.*services_bench INFO //' | cut -c1-330 ;;
  cut)
    old=${OLD:-.devcarry/old}; here=$PWD
    (cd "$old" && python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto)
    ab=(--device cuda --ipc on --max-new-tokens 128 --max-context 1024 --concurrency 1,16,64 --prompts 32
        --requests-per-worker "${PER_WORKER:-4}" --modes tree:6x60 --colocate on --head "$here/models/eagle3-smollm2")
    for i in 1 2; do
      timeout 150 python3 -m bench.services_bench "${ab[@]}" --out "/tmp/ab-$i-new" > "$out/ab-$i-new.log" 2>&1
      (cd "$old" && timeout 150 python3 -m bench.services_bench "${ab[@]}" --out "/tmp/ab-$i-old") > "$out/ab-$i-old.log" 2>&1
      cp "/tmp/ab-$i-new/services.json" "$out/ab-$i-new.json" 2>/dev/null
      cp "/tmp/ab-$i-old/services.json" "$out/ab-$i-old.json" 2>/dev/null
    done
    timeout 200 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 --concurrency 1,16,64 \
      --methods closed --requests-per-worker "${PER_WORKER:-4}" --out /tmp/engine-cut > "$out/engine.log" 2>&1
    cp /tmp/engine-cut/engine_bench.json "$out/" 2>/dev/null
    for f in "$out"/ab-*.log; do echo "$f"; grep -hE "tok/s total" "$f" | sed 's/.*services_bench INFO //' | cut -c1-200; done
    grep -E "^(speculative|closed)" "$out/engine.log" ;;
  diag)
    timeout 200 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 --concurrency 1,16,64 \
      --methods closed --requests-per-worker "${PER_WORKER:-4}" --out /tmp/engine-diag > "$out/engine.log" 2>&1
    cp /tmp/engine-diag/engine_bench.json "$out/" 2>/dev/null; grep -E "^speculative" "$out/engine.log"
    timeout 170 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 \
      --requests-per-worker "${PER_WORKER:-4}" --modes tree:6x60 --colocate on --out "$out/diag" > "$out/diag.log" 2>&1
    grep -hE "tok/s total" "$out/diag.log" | sed 's/.*services_bench INFO //' | cut -c1-420
    python3 -m pip install -q --no-deps --target /tmp/pyspy .devcarry/b/wheels/py_spy-*.whl; export PATH="/tmp/pyspy/bin:$PATH"
    timeout 150 python3 -m bench.profile_services --out /tmp/prof16 --concurrency 16 --seconds 6 --rounds-per-call 4 \
      --colocate > "$out/profile-c16.log" 2>&1
    cp /tmp/prof16/profile.md "$out/profile16.md" 2>/dev/null; sed -n 1,12p "$out/profile16.md"
    tar czf "$out/spy16.tgz" -C /tmp prof16 ;;
  ab15)
    old=${OLD:-.devcarry/old}; here=$PWD; pw=${PER_WORKER:-8}
    for d in "$old" ${MID:-.devcarry/mid}; do
      [ -d "$d" ] && (cd "$d" && python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto)
    done
    [ -z "${SKIP_ENGINE:-}" ] && closed_engine engine 240  # first on a fresh machine: it compiles the kernels
    ab=(--device cuda --ipc on --max-new-tokens 128 --max-context 1024 --concurrency 1,16,64 --prompts 32
        --requests-per-worker "$pw" --modes tree:6x60 --colocate on --head "$here/models/eagle3-smollm2")
    for run in ${RUNS:-1-new 2-old 3-old 4-new}; do  # NAME-new: this tree, NAME-new8: at 8 rounds, NAME-old: OLD
      if [ -n "${GCPROBE:-}" ]; then export GC_PROBE_OUT="/tmp/gc-$run" PYTHONPATH="$here/bench/gcprobe:$PYTHONPATH"; fi
      case "${run#*-}" in
        new) timeout 110 python3 -m bench.services_bench "${ab[@]}" --out "/tmp/ab-$run" > "$out/ab-$run.log" 2>&1 ;;
        new8) timeout 110 python3 -m bench.services_bench "${ab[@]}" --rounds-per-call 8 --out "/tmp/ab-$run" \
          > "$out/ab-$run.log" 2>&1 ;;
        old) (cd "$old" && timeout 110 python3 -m bench.services_bench "${ab[@]}" --out "/tmp/ab-$run") > "$out/ab-$run.log" 2>&1 ;;
        mid) (cd "${MID:-.devcarry/mid}" && timeout 110 python3 -m bench.services_bench "${ab[@]}" --out "/tmp/ab-$run") \
          > "$out/ab-$run.log" 2>&1 ;;
      esac
      cp "/tmp/ab-$run/services.json" "$out/ab-$run.json" 2>/dev/null
      echo "$run"; grep -hE "tok/s total" "$out/ab-$run.log" | sed 's/.*services_bench INFO //' | cut -c1-600
      if [ -n "${GCPROBE:-}" ]; then
        export PYTHONPATH="${PYTHONPATH#"$here/bench/gcprobe:"}"; unset GC_PROBE_OUT
        python3 -m bench.gcprobe.summary "/tmp/gc-$run" --log "$out/ab-$run.log" > "$out/gc-$run.txt" 2>&1
        grep -E "verifier|c=" "$out/gc-$run.txt"
      fi
      grep -h "inline engine calls" "/tmp/ab-$run"/logs/*/*.log 2>/dev/null | sed 's/^[^ ]* [^ ]* //'
    done
    if [ -n "${ENGINE_AFTER:-}" ]; then closed_engine engine-after 150; fi ;;
  chainab)
    # session 20: the device chain (the draft launched behind the verify on the device) against the code before it
    # (OLD, default .devcarry/old: 3221481's services, common, protos and bench): the engine's closed loop alternated
    # new, old, old, new (6x60, c=1, 16, 64, PER_WORKER 4 requests per worker)
    old=${OLD:-.devcarry/old}; export PER_WORKER=${PER_WORKER:-4}
    (cd "$old" && python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto)
    for run in ${RUNS:-1-new 2-old 3-old 4-new}; do
      case "${run#*-}" in new) d=.;; *) d=$old;; esac
      echo "$run"; (cd "$d" && closed_engine "engine-$run" 140)
    done ;;
  ratio)
    # session 19: the services against the engine in process, turn by turn in one run (bench.split_ratio): REPS (6)
    # windows each per concurrency, the orders alternating, PER_WORKER (8) requests per worker
    timeout 570 python3 -m bench.split_ratio --device cuda --head models/eagle3-smollm2 --concurrency 1,16,64 \
      --reps "${REPS:-6}" --requests-per-worker "${PER_WORKER:-8}" --out /tmp/ratio > "$out/ratio.log" 2>&1
    cp /tmp/ratio/split_ratio.json "$out/" 2>/dev/null; grep -E "split_ratio INFO" "$out/ratio.log" | sed 's/.*INFO //' ;;
  place)
    # session 19: does a core of its own steady the services' engine calls? The engine process on ENGINE_CPUS (2,4) with
    # every other process (gateway, client) off those CPUs and off their measured siblings (bench.cpu_siblings),
    # against the OS's placement, RUNS in order (default 1-free 2-own 3-own 4-free), then the engine's closed loop
    # with the OS's placement and on ENGINE_CPUS; 6x60 pinned, c=1, 16, 64, PER_WORKER (8) requests per worker
    ecpus=${ENGINE_CPUS:-2,4}; pw=${PER_WORKER:-8}; : > "$out/siblings.json"
    for c in ${ecpus//,/ }; do timeout 60 python3 -m bench.cpu_siblings --cpu "$c" | tee -a "$out/siblings.json"; done
    rest=$(python3 -c "import json, os, sys
taken = set().union(*({d['cpu'], *d['siblings']} for d in map(json.loads, open(sys.argv[1]))))
print(','.join(str(c) for c in sorted(os.sched_getaffinity(0) - taken)))" "$out/siblings.json")
    echo "engine process on $ecpus, the others on $rest"
    ab=(--device cuda --ipc on --max-new-tokens 128 --max-context 1024 --concurrency 1,16,64 --prompts 32
        --requests-per-worker "$pw" --modes tree:6x60 --colocate on --head models/eagle3-smollm2)
    for run in ${RUNS:-1-free 2-own 3-own 4-free}; do
      case "${run#*-}" in
        free) timeout 110 python3 -m bench.services_bench "${ab[@]}" --out "/tmp/place-$run" > "$out/place-$run.log" 2>&1 ;;
        own) taskset -c "$rest" timeout 110 python3 -m bench.services_bench "${ab[@]}" --engine-cpus "$ecpus" \
          --out "/tmp/place-$run" > "$out/place-$run.log" 2>&1 ;;
      esac
      cp "/tmp/place-$run/services.json" "$out/place-$run.json" 2>/dev/null
      echo "$run"; grep -hE "tok/s total" "$out/place-$run.log" | sed 's/.*services_bench INFO //' | cut -c1-330
    done
    for run in ${ENGINES-free own}; do  # ENGINES="": none
      pin=(); [ $run = own ] && pin=(taskset -c "$ecpus")
      echo "engine $run"; closed_engine "engine-$run" 150 "${pin[@]}"
    done ;;
  poll)
    pw=${PER_WORKER:-8}
    timeout 200 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 \
      --concurrency 1,16,64 --methods plain,spec,closed --requests-per-worker "$pw" --out /tmp/engine-poll \
      > "$out/engine.log" 2>&1
    cp /tmp/engine-poll/engine_bench.json "$out/" 2>/dev/null; grep -E "^(speculative|plain)" "$out/engine.log"
    lp=(--device cuda --ipc on --max-new-tokens 128 --max-context 1024 --concurrency 1,16,64 --prompts 32
        --requests-per-worker "$pw" --modes tree:6x60,plain --colocate on --head models/eagle3-smollm2)
    for run in ${RUNS:-1-poll 2-block 3-block 4-poll}; do
      extra=(); [ "${run#*-}" = block ] && extra=(--block-on-device)
      timeout 110 python3 -m bench.services_bench "${lp[@]}" "${extra[@]}" --out "/tmp/poll-$run" > "$out/poll-$run.log" 2>&1
      echo "$run"; grep -hE "tok/s total" "$out/poll-$run.log" | sed 's/.*services_bench INFO //' | cut -c1-700
    done ;;
  stallab)
    st=(--device cuda --concurrency 16 --prompt-tokens 2000)
    timeout 300 python3 -m bench.prefill_stall "${st[@]}" --colocate off --prefill-chunk "${STALL_RUNS:-512,0,512}" --out /tmp/stall-new \
      > "$out/stall-new.log" 2>&1
    echo new; grep -E "^\| (whole|512)" "$out/stall-new.log"
    if [ -n "${OLD:-}" ]; then  # an older tree to compare with, unpacked as for `cut`
      here=$PWD
      (cd "$OLD" && ln -sfn "$here/models" models && python3 -m grpc_tools.protoc -Iprotos --python_out=. \
        --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto)
      (cd "$OLD" && timeout 150 python3 -m bench.prefill_stall "${st[@]}" --prefill-chunk 512,0 --out /tmp/stall-old) \
        > "$out/stall-old.log" 2>&1
      echo old; grep -E "^\| (whole|512)" "$out/stall-old.log"
    fi ;;
  stallwhy)
    st=(--device cuda --concurrency 16 --prompt-tokens 2000 --scrape-ms 50)
    timeout 250 python3 -m bench.prefill_stall "${st[@]}" --colocate off --prefill-chunk "${STALL_RUNS:-512,512,512}" --out "$out/3p" \
      > "$out/stall-3p.log" 2>&1
    echo three processes; grep -E "^\| (whole|512)" "$out/stall-3p.log"
    timeout 200 python3 -m bench.prefill_stall "${st[@]}" --prefill-chunk "${STALL_RUNS:-512,512,512}" --colocate \
      --out "$out/co" > "$out/stall-co.log" 2>&1
    echo colocated; grep -E "^\| (whole|512)" "$out/stall-co.log"
    for d in $(ls -dt /tmp/specdec-* | grep -v specdec-model | head -6); do  # the stacks' catch-ups and warnings
      echo "== $d"; grep -hE "catches up|WARNING|ERROR|Traceback" "$d"/*.log | cut -c1-200 | tail -40; done > "$out/stack-events.txt"
    grep -hE "sent_at" "$out"/stall-*.log | grep -oE "'(speculative|sent_at|ratio)': [^,]*" | paste - - - ;;
  lanes)
    pw=${PER_WORKER:-8}
    timeout 150 python3 -m bench.engine_bench --device cuda --head models/eagle3-smollm2 --prompts 32 --concurrency 16,64 \
      --methods closed --requests-per-worker "$pw" --out /tmp/engine-lanes > "$out/engine.log" 2>&1
    grep -E "^speculative" "$out/engine.log"
    lp=(--device cuda --ipc on --max-new-tokens 128 --max-context 1024 --concurrency 16,64 --prompts 32
        --requests-per-worker "$pw" --modes tree:6x60,spec --colocate on --head models/eagle3-smollm2)
    for run in 1-one 2-two 3-two 4-one; do
      groups=1; [ "${run#*-}" = two ] && groups=2
      timeout 110 python3 -m bench.services_bench "${lp[@]}" --round-groups "$groups" --out "/tmp/lanes-$run" \
        > "$out/lanes-$run.log" 2>&1
      echo "$run"; grep -hE "tok/s total" "$out/lanes-$run.log" | sed 's/.*services_bench INFO //' | cut -c1-700
    done ;;
  stalldiag)
    find /tmp -maxdepth 1 -name 'specdec-*' ! -name specdec-model -exec rm -rf {} +  # earlier stacks' logs
    timeout 200 python3 -m bench.prefill_stall --device cuda --concurrency 16 --prompt-tokens 2000 --colocate off \
      --prefill-chunk 512,512,512 --out /tmp/stall-diag > "$out/stall-diag.log" 2>&1
    grep -E "^\| (whole|512)" "$out/stall-diag.log"
    for d in $(ls -d /tmp/specdec-* | grep -v specdec-model); do echo "== $d"; grep -hE "WARNING|ERROR|Traceback|failed" "$d"/*.log | cut -c1-300 | head -20; done \
      > "$out/stack-warnings.txt"; head -c 6000 "$out/stack-warnings.txt"
    timeout 240 python3 -m pytest -q -m gpu tests/gpu/test_gpu_engines.py > "$out/gpu-engines.txt" 2>&1; tail -3 "$out/gpu-engines.txt" ;;
  probeab)
    old=${OLD:-.devcarry/old}; here=$PWD; ln -sfn "$here/models" "$old/models"
    (cd "$old" && python3 -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. protos/specdec/v1/*.proto)
    g=$(realpath "${GHZ:-.devcarry/g/ghz}")
    for run in new old; do
      d=.; [ $run = old ] && d=$old
      (cd "$d" && timeout 250 python3 -m bench.ghz_load --ghz "$g" --device cuda --concurrency 1,16,64 \
        --requests-per-worker 2 --out "/tmp/ghz-$run") > "$out/ghz-$run.txt" 2>&1
      cp "/tmp/ghz-$run/ghz.md" "$out/ghz-$run.md" 2>/dev/null; echo "ghz $run"; grep "^| [0-9]" "$out/ghz-$run.md"
    done
    ab=(--device cuda --ipc on --max-new-tokens 128 --max-context 1024 --concurrency 16,64 --prompts 32
        --requests-per-worker "${PER_WORKER:-4}" --modes spec --colocate on --head "$here/models/eagle3-smollm2")
    for run in new old; do
      d=.; [ $run = old ] && d=$old
      (cd "$d" && timeout 110 python3 -m bench.services_bench "${ab[@]}" --out "/tmp/pab-$run") > "$out/pab-$run.log" 2>&1
      cp "/tmp/pab-$run/services.json" "$out/pab-$run.json" 2>/dev/null
      echo "services $run"; grep -hE "tok/s total" "$out/pab-$run.log" | sed 's/.*services_bench INFO //' | cut -c1-200
    done ;;
  probe)
    timeout 280 python3 -m bench.ghz_load --ghz "${GHZ:-.devcarry/g/ghz}" --device cuda --concurrency 1,16,64 \
      --requests-per-worker 2 --out /tmp/specdec-ghz-probe > "$out/ghz.txt" 2>&1
    cp /tmp/specdec-ghz-probe/ghz.md "$out/" 2>/dev/null; grep "^|" "$out/ghz.md"
    timeout 280 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 \
      --requests-per-worker "${PER_WORKER:-4}" --modes spec,plain,tree:6x60 --colocate on --out /tmp/probe \
      > "$out/probe.log" 2>&1
    cp /tmp/probe/services.json "$out/probe.json" 2>/dev/null
    grep -hE "tok/s total" "$out/probe.log" | sed 's/.*services_bench INFO //' | cut -c1-260 ;;
  codefault)
    timeout 400 "${load[@]}" --head models/eagle3-smollm2 --concurrency 1,16,64 --prompts 32 \
      --requests-per-worker "${PER_WORKER:-4}" --modes spec,plain,tree:6x60 --colocate off,on --out /tmp/codefault \
      > "$out/codefault.log" 2>&1
    cp /tmp/codefault/services.json "$out/codefault.json" 2>/dev/null
    grep -hE "tok/s total" "$out/codefault.log" | sed 's/.*services_bench INFO //' | cut -c1-260
    timeout 170 python3 -m bench.ghz_load --ghz "${GHZ:-.devcarry/g/ghz}" --device cuda --concurrency 1,16,64 \
      --requests-per-worker 2 --colocate --out /tmp/specdec-ghz-colo > "$out/ghz-colocated.txt" 2>&1
    cp /tmp/specdec-ghz-colo/ghz.md "$out/ghz-colocated.md" 2>/dev/null; tail -12 "$out/ghz-colocated.txt" ;;
  stallghz)
    timeout 250 python3 -m bench.prefill_stall --device cuda --concurrency 16 --prompt-tokens 2000 --colocate off \
      --prefill-chunk 0,512 --out "$out" > "$out/stall.log" 2>&1; tail -8 "$out/stall.log"
    timeout 250 python3 -m bench.ghz_load --ghz "${GHZ:-.devcarry/g/ghz}" --device cuda --concurrency 1,16,64 \
      --requests-per-worker 2 --colocate off --out /tmp/specdec-ghz > "$out/ghz.txt" 2>&1
    cp /tmp/specdec-ghz/ghz.md "$out/" 2>/dev/null; tail -12 "$out/ghz.txt" ;;
  profile4)
    python3 -m pip install -q --no-deps --target /tmp/pyspy .devcarry/b/wheels/py_spy-*.whl; export PATH="/tmp/pyspy/bin:$PATH"
    for c in 1 64; do
      timeout 200 python3 -m bench.profile_services --out "/tmp/prof-on-4-c$c" --concurrency $c --seconds 6 \
        --rounds-per-call 4 --colocate > "$out/profile-c$c.log" 2>&1
      echo "c=$c:"; sed -n 3p "/tmp/prof-on-4-c$c/profile.md"
    done
    tar czf "$out/spy.tgz" -C /tmp prof-on-4-c1 prof-on-4-c64 ;;
  fixcheck)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engines.py -k move_rows \
      > "$out/fixcheck.log" 2>&1; tail -3 "$out/fixcheck.log"
    timeout 400 python3 -m bench.prefill_stall --device cuda --concurrency 16 --prompt-tokens 2000 --colocate off \
      --prefill-chunk 0,512 --out "$out" > "$out/stall.log" 2>&1; tail -8 "$out/stall.log" ;;
  profile)
    [ -n "${SKIP_TESTS:-}" ] || timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_services.py > "$out/gpu_tests.log" 2>&1
    tail -3 "$out/gpu_tests.log" 2>/dev/null
    python3 -m pip install -q --no-deps --target /tmp/pyspy .devcarry/b/wheels/py_spy-*.whl; export PATH="/tmp/pyspy/bin:$PATH"
    for c in 1 64; do
      timeout 150 python3 -m bench.profile_services --out "/tmp/prof$c" --concurrency $c --seconds 5 --colocate off > "$out/profile$c.log" 2>&1
      cp "/tmp/prof$c/profile.md" "$out/profile$c.md"; tar czf "$out/spy$c.tgz" -C "/tmp/prof$c" .
    done; head -4 "$out"/profile*.md ;;
  sampling)
    timeout 500 python3 -m bench.sampling_accept --device cuda --prompts 48 --max-new-tokens 128 --out "$out" \
      > "$out/sampling.log" 2>&1; tail -8 "$out/sampling.log" ;;
  colocate)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_services.py > "$out/gpu_tests.log" 2>&1
    tail -2 "$out/gpu_tests.log"
    for c in off on off; do  # off first: its two processes fill the kernel cache that a colocated start
      # would otherwise fill one engine after the other (over 130 s on a fresh machine)
      timeout 130 "${load[@]}" --concurrency 1,16,64 --prompts 32 --requests-per-worker 2 \
        --modes tree:6x60,spec,plain --colocate $c --out "$out/colocate-$c" > "$out/colocate-$c.log" 2>&1
      echo "colocate $c:"; grep -E "tok/s total" "$out/colocate-$c.log" | sed 's/.*services_bench INFO //' | cut -c1-200
    done ;;
  groups)
    for g in 1 2 1 2; do
      timeout 140 "${load[@]}" --concurrency 16,64 --prompts 32 --requests-per-worker 2 --modes tree:6x60,spec \
        --round-groups $g --out "$out/groups$g" > "$out/groups$g.log" 2>&1
      echo "round groups $g:"; grep -E "tok/s total" "$out/groups$g.log"
    done ;;
  magpie)
    w=/tmp/specdec-train; mkdir -p "$w"; [ -f .devcarry/magpie.tgz ] && tar xzf .devcarry/magpie.tgz -C "$w"
    timeout 560 python3 -m training.pipeline prompts --workdir "$w" --device cuda --magpie "${MAGPIE:-120000}" \
      --magpie-batch "${MAGPIE_BATCH:-1024}" --magpie-shard 2048 --minutes "${MINUTES:-8.5}" > "$out/magpie.log" 2>&1
    tar czf "$out/magpie.tgz" -C "$w" magpie; ls "$w/magpie" | wc -l; tail -4 "$out/magpie.log" ;;
  *) echo "usage: $0 load|order|rpc|tests|chain|stall|kernels|bench|split|split2|fixcheck|rest|profile|sampling|groups|magpie" >&2; exit 2 ;;
esac
