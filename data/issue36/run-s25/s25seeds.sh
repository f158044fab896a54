# Session 25, GPU pair: the sampled requests again, 8 seeds a prompt (the first pass is the earlier run's): head R on
# GPU 0, the shipped head on GPU 1. Sourced after join.sh.
set -o pipefail
mkdir -p /tmp/e
(CUDA_VISIBLE_DEVICES=0 python -m bench.accept --head .devcarry/hr/head --temperatures 0.7 --seeds 8 --out /tmp/e/seeds-r > /tmp/e/seeds-r.log 2>&1; echo "r rc=$?") &
p0=$!
(CUDA_VISIBLE_DEVICES=1 python -m bench.accept --temperatures 0.7 --seeds 8 --out /tmp/e/seeds-s > /tmp/e/seeds-s.log 2>&1; echo "s rc=$?") &
p1=$!
wait $p0 $p1
for v in r s; do tail -n 3 /tmp/e/seeds-$v/accept.md; grep "requests in" /tmp/e/seeds-$v.log; done
python -m bench.accept --compare /tmp/e/seeds-s/accept.json /tmp/e/seeds-r/accept.json
tar czf $OUT/seeds.tgz -C /tmp e; ls -la $OUT
