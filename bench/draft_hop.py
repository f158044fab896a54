"""What a propose to a draft service in another process costs, and where the time goes: the hop that the
three-process stack (--colocate off) puts on every round's critical path, against the same drafter called in
this process (the colocated stack's draft has no hop), measured in the same run.

    python -m bench.draft_hop --out DIR [--device cuda] [--mps] [--proposes 400] [--per-sequence 100]

Starts `python -m services.draft` (the shipped head, the service's defaults) on a loopback port, with --mps
under the CUDA MPS control daemon as the stack runs it (started if none is running, quit at the end; this
process joins it too), and drives it as the verifier does (services.verifier.remote_draft.RemoteDrafter:
hidden states by CUDA IPC on a GPU, inline bytes on CPU). Sequences one at a time: each started with a
32-token prompt, then --per-sequence proposes of 4 new tokens (a round's accepted tokens and its bonus) for trees of 60
nodes, then released; --proposes in all, random features (the trees' shape does not depend on them). Then the
same sequences and proposes through a drafter built in this process (services.draft.build_drafter). Figures in
microseconds, median and p90 of each sequence's proposes after its first 10:
- in process: the drafter's propose here (trees on the host, so the device work is waited for);
- remote: RemoteDrafter.propose as the engine core calls it (features written and waited for, the request
  built, the call, the trees parsed);
- round trip: the Propose call alone; draft compute: the service's own time inside it
  (ProposeResponse.compute_us: its drafter's propose and stream synchronisation); transport: round trip less
  draft compute (gRPC, protobuf, the service's executor hop and checks), per propose;
- Info: a bare unary RPC to the same service, for scale.
Writes DIR/draft_hop.json and DIR/draft_hop.md (also printed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.load import ROOT, git_commit
from services.stack import bind_to_parent

log = logging.getLogger("bench.draft_hop")
PROMPT = 32  # tokens of each sequence's first propose
NEW = 4  # tokens a later propose carries: a round's accepted tokens and its bonus
NODES = 60  # the trees' size (the pinned 6x60 tree's)
SEQUENCES = 2  # the drafters' capacity (one sequence is drafted at a time): fewer CUDA graphs to capture
SKIP = 10  # each sequence's first proposes left out of the figures (the service's first-use work)


def spread(samples: list[float]) -> dict[str, float]:
    """Median and p90 (the sample at rank floor(0.9 n) of the sorted samples) and the count:
    [5, 1, 4, 2, 3] -> median 3, p90 5 (rank 4 of 0..4), n 5."""
    s = sorted(samples)
    return {"median": statistics.median(s), "p90": s[int(0.9 * len(s))], "n": len(s)}


def kept(per_sequence: list[list[float]]) -> list[float]:
    """The samples of every sequence after its first SKIP: [[1] * 12, [2] * 11] -> [1, 1, 2]."""
    return [x for seq in per_sequence for x in seq[SKIP:]]


def timed(calls: int, fn: Callable[[int], object]) -> list[float]:
    """fn(0) .. fn(calls - 1), each call's wall time in microseconds."""
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def start_draft(args: list[str], env: dict[str, str], workdir: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """`python -m services.draft ARGS` on a free loopback port: the process and its address once it listens."""
    port_file = workdir / "draft.port"
    log_path = workdir / "draft.log"
    cmd = [sys.executable, "-m", "services.draft", "--addr", "127.0.0.1:0", "--port-file", str(port_file), *args]
    with log_path.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=bind_to_parent)
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the draft exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"the draft did not listen within {timeout:.0f} s (log: {log_path})")
        time.sleep(0.2)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def run(a: argparse.Namespace, env: dict[str, str], workdir: Path) -> dict:
    """The remote figures, then the in-process ones, over the same proposes."""
    import torch

    from common.engine.base import ProposeInput
    from common.engine.factory import pick_dtype
    from common.engine.verifier import torch_dtype
    from services.draft.__main__ import DraftServiceConfig, build_drafter
    from services.verifier.remote_draft import RemoteDrafter
    from specdec.v1 import internal_pb2 as pb

    device = torch.device(a.device)
    cfg = DraftServiceConfig(device=a.device)
    built = build_drafter(cfg, SEQUENCES)  # the service builds the same drafter from the same defaults
    dtype = torch_dtype(pick_dtype(a.device))  # the features' dtype: the engines' on this device
    g = torch.Generator().manual_seed(0)
    sequences = a.proposes // a.per_sequence

    def hidden(k: int) -> torch.Tensor:
        return torch.randn(k, built.hidden_width, generator=g).to(device, dtype)  # [k, 3H]

    def first(sid: str) -> ProposeInput:
        return ProposeInput(sid, list(range(100, 100 + PROMPT)), hidden(PROMPT), True, [1], NODES)

    def later(sid: str, i: int) -> ProposeInput:
        return ProposeInput(sid, [200 + i % 50] * NEW, hidden(NEW), False, [], NODES)

    class Timed(RemoteDrafter):
        """The Propose calls' round trips and the service's compute_us, as (round trip, compute) in us."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.calls: list[tuple[float, float]] = []

        def _call(self, name, request):
            t0 = time.perf_counter()
            resp = super()._call(name, request)
            if isinstance(resp, pb.ProposeResponse):
                self.calls.append(((time.perf_counter() - t0) * 1e6, float(resp.compute_us)))
            return resp

    proc, address = start_draft(
        ["--device", a.device, "--max-sequences", str(SEQUENCES)], env, workdir, a.start_timeout
    )
    try:
        remote = Timed(
            address, "bench", 30.0, device, built.vocab_size, export_shape=(2, PROMPT, built.hidden_width, dtype)
        )
        if remote.connect(a.start_timeout) is None:
            raise RuntimeError(f"the draft at {address} did not answer")
        transport = "CUDA IPC" if remote.export is not None else "inline bytes"
        transport += ", calls on the same-host link" if remote.link is not None else ", calls through gRPC"
        remote_us, trips, computes = [], [], []
        for s in range(sequences):
            remote.propose([first(f"r{s}")])
            remote.calls.clear()
            remote_us.append(timed(a.per_sequence, lambda i, s=s: remote.propose([later(f"r{s}", i)])))
            trips.append([t for t, _ in remote.calls])
            computes.append([c for _, c in remote.calls])
            remote.release([f"r{s}"])
        info_us = timed(a.proposes, lambda i: remote.stub.Info(pb.InfoRequest(), timeout=5.0))
        remote.close()
    finally:
        proc.terminate()
        proc.wait(60)
    local_us = []
    for s in range(sequences):
        built.drafter.propose([first(f"l{s}")])
        local_us.append(timed(a.per_sequence, lambda i, s=s: built.drafter.propose([later(f"l{s}", i)])))
        built.drafter.release([f"l{s}"])
    gaps = [[t - c for t, c in zip(ts, cs)] for ts, cs in zip(trips, computes)]
    return {
        "transport": transport,
        "figures": {
            "in process": spread(kept(local_us)),
            "remote": spread(kept(remote_us)),
            "round trip": spread(kept(trips)),
            "draft compute": spread(kept(computes)),
            "transport": spread(kept(gaps)),
            "Info": spread(info_us[SKIP:]),
        },
    }


def markdown(result: dict, meta: dict) -> str:
    f = result["figures"]
    base = f["in process"]["median"]
    lines = [
        "# A propose to the draft service: the hop against the drafter in process",
        "",
        f"`{meta['command']}` at {meta['commit']} on {meta['device_name']}, {meta['mps']}; hidden states by "
        f"{result['transport']}. One sequence at a time, {NEW} new tokens a propose, {NODES}-node trees; "
        f"microseconds over {f['remote']['n']} proposes.",
        "",
        "| what | median us | p90 us | / in process |",
        "|---|---:|---:|---:|",
    ]
    for name, s in f.items():
        lines.append(f"| {name} | {s['median']:.0f} | {s['p90']:.0f} | {s['median'] / base:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.draft_hop", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench-results/draft_hop"))
    p.add_argument("--device", default="cuda", help="the draft's and this process's device")
    p.add_argument("--mps", action="store_true", help="under the CUDA MPS control daemon, as the stack runs it")
    p.add_argument("--proposes", type=int, default=400, help="proposes of each kind (whole sequences)")
    p.add_argument(
        "--per-sequence", type=int, default=100, help=f"proposes of one sequence before it is released (> {SKIP})"
    )
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the draft to start")
    a = p.parse_args(argv)
    if a.per_sequence <= SKIP:
        p.error(f"--per-sequence takes more than the {SKIP} proposes a sequence's figures leave out")
    if a.proposes < a.per_sequence or a.proposes % a.per_sequence:
        p.error(f"--proposes takes a multiple of --per-sequence ({a.per_sequence})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    mps = None
    if a.mps:
        from services.mps import Mps

        mps = Mps.start(os.environ)
        if mps is None:
            p.error("--mps: the CUDA MPS daemon could not be had (the log above says why)")
        env |= mps.env
        os.environ.update(mps.env)  # before this process's first CUDA call: it joins the daemon too
    try:
        with tempfile.TemporaryDirectory(prefix="specdec-hop-") as tmp:
            result = run(a, env, Path(tmp))
    finally:
        if mps is not None:
            mps.stop()
    import torch

    meta = {
        "command": "python -m bench.draft_hop " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": git_commit(ROOT),
        "device_name": torch.cuda.get_device_name() if a.device.startswith("cuda") else "CPU",
        "mps": "under CUDA MPS" if a.mps else "no MPS",
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "draft_hop.json").write_text(json.dumps(result | {"meta": meta}, indent=1))
    md = markdown(result, meta)
    (a.out / "draft_hop.md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
