# Session 25, GPU pair: bench.accept (144 held-out prompts) of R (GPU 0) and S (GPU 1); then the proposal's cost
# (decode_probe, GPU 1: R and the shipped head) and the hop to a draft service (draft_hop --mps, GPU 0; the daemon
# it starts is quit at its end, and again here). Sourced after join.sh.
set -o pipefail
mkdir -p /tmp/b
(CUDA_VISIBLE_DEVICES=0 python -m bench.accept --head /tmp/wr/head --out /tmp/b/acc-r > /tmp/b/acc-r.log 2>&1; echo "acc r rc=$?") &
p0=$!
(CUDA_VISIBLE_DEVICES=1 python -m bench.accept --head /tmp/ws/head --out /tmp/b/acc-s > /tmp/b/acc-s.log 2>&1; echo "acc s rc=$?") &
p1=$!
wait $p0 $p1
for v in r s; do cat /tmp/b/acc-$v/accept.md | tail -n 6; done
for h in r shipped; do hd=models/eagle3-smollm2; [ $h = r ] && hd=/tmp/wr/head;
  CUDA_VISIBLE_DEVICES=1 python -m bench.decode_probe --head $hd --batches 1,16 --out /tmp/b/probe-$h > /tmp/b/probe-$h.log 2>&1; echo "probe $h rc=$?"
  grep -i -E "propos|decode" /tmp/b/probe-$h/decode_probe.md | head -6; done
CUDA_VISIBLE_DEVICES=0 timeout 150 python -m bench.draft_hop --device cuda --mps --out /tmp/b/hop-mps > /tmp/b/hop-mps.log 2>&1; echo "hop mps rc=$?"
echo quit | nvidia-cuda-mps-control 2>/dev/null
CUDA_VISIBLE_DEVICES=0 timeout 120 python -m bench.draft_hop --device cuda --out /tmp/b/hop > /tmp/b/hop.log 2>&1; echo "hop rc=$?"
cat /tmp/b/hop-mps/draft_hop.md /tmp/b/hop/draft_hop.md 2>/dev/null || tail -20 /tmp/b/hop-mps.log /tmp/b/hop.log
tar czf $OUT/bench.tgz -C /tmp b; ls -la $OUT
