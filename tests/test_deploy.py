"""The Kubernetes manifests: valid against the API schemas offline (kubernetes-validate --strict), and
deployable as the services need: probes reach every container (no service bound to loopback where a
probe dials the pod IP), a drain fits in the termination grace, internal ports are closed by a
NetworkPolicy, metrics are exposed, a PodDisruptionBudget exists, and a GPU variant requests the GPU.
The probes restart a wedged pod and not a recovering one: a startup probe covers the model's load and the
CUDA graph capture, and a liveness probe on the gateway's health (NOT_SERVING while the verifier restarts)
fails only after longer than a restart takes. The MPS variant runs the draft and the verifier as containers of
their own, each with a GPU replica, on a node whose one GPU they share, with no supervisor in the pod (the kubelet
restarts a container)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

MANIFESTS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "k8s").glob("*.yaml"))
PUBLIC_PORTS = {50051, 9090}
GRAPH_CAPTURE_S = 90  # a GPU verifier's start on a fresh machine: the model's load and the CUDA graph capture
RESTART_S = {"gpu": GRAPH_CAPTURE_S + 8 + 20, "cpu": 60}  # a verifier's restart: its start, the backoff, a margin
MPS = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "specdec-gpu-mps.yaml"
KUBELET_BACKOFF_S = 10  # the kubelet's first back-off before it restarts a container (doubling, up to 5 min)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _flag(command: list[str], name: str) -> str | None:
    for i, arg in enumerate(command):
        if arg == name:
            return command[i + 1]
        if arg.startswith(f"{name}=") or arg.startswith(f"--gateway-arg={name}="):
            return arg.rsplit("=", 1)[1]
    return None


def test_manifests_validate_strictly():
    exe = Path(sys.executable).parent / "kubernetes-validate"
    exe = str(exe) if exe.exists() else shutil.which("kubernetes-validate")
    assert exe, "kubernetes-validate is not installed (requirements-dev.txt)"
    r = subprocess.run([exe, "--strict", *map(str, MANIFESTS)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(MANIFESTS) >= 2


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_manifest_is_deployable(path):
    docs = {d["kind"]: d for d in _docs(path)}
    assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= docs.keys()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    for c in pod["containers"]:
        cmd = c["command"]
        addr = _flag(cmd, "--addr")
        probed = {p.get("grpc", {}).get("port") for p in (c.get("readinessProbe", {}), c.get("livenessProbe", {}))}
        if addr is not None and int(addr.rsplit(":", 1)[1]) in probed:
            assert not addr.startswith("127."), f"{c['name']} binds {addr}: the kubelet's probe dials the pod IP"
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        drain = float(_flag(cmd, "--drain-grace"))
        margin = 10 if "services.stack" in cmd else 0
        assert grace > int(pre_stop[1]) + drain + margin, c["name"]
    ports = {c["containerPort"] for c in pod["containers"] for c in c.get("ports", [])}
    assert 9090 in ports and any(_flag(c["command"], "--metrics-port") == "9090" for c in pod["containers"])
    ingress = docs["NetworkPolicy"]["spec"]["ingress"]
    assert {p["port"] for rule in ingress for p in rule["ports"]} == PUBLIC_PORTS
    assert docs["NetworkPolicy"]["spec"]["podSelector"] == docs["Deployment"]["spec"]["selector"]
    if "gpu" in path.name:
        assert any(c["resources"]["limits"].get("nvidia.com/gpu") == 1 for c in pod["containers"])


def _budget(probe: dict) -> float:
    """Seconds a probe may fail before the kubelet acts: period x failure threshold (the API's defaults: 10, 3)."""
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_probes_restart_a_wedged_pod_and_not_a_recovering_one(path):
    """Every container has a startup probe (on a GPU: long enough for the graph capture) and gRPC readiness; a
    liveness probe on the gateway's health (NOT_SERVING while the verifier restarts) tolerates a restart."""
    kind = "gpu" if "gpu" in path.name else "cpu"
    pod = {d["kind"]: d for d in _docs(path)}["Deployment"]["spec"]["template"]["spec"]
    for c in pod["containers"]:
        assert "grpc" in c["readinessProbe"], c["name"]
        startup = c["startupProbe"]
        assert _budget(startup) >= (2 * GRAPH_CAPTURE_S if kind == "gpu" else RESTART_S["cpu"]), c["name"]
        for probe in (c["readinessProbe"], c["livenessProbe"]):
            assert "initialDelaySeconds" not in probe, f"{c['name']}: the startup probe gates the others"
        live = c["livenessProbe"]
        if live.get("grpc", {}).get("port") == 50051 and not live["grpc"].get("service"):
            assert _budget(live) >= RESTART_S[kind], f"{c['name']}: liveness would kill a pod whose verifier restarts"


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_commands_use_todays_flags(path):
    """No sequence leases (a gateway's sequences live as long as its stream to the verifier), and the gateway talks
    to the verifier only: the verifier talks to the draft."""
    pod = {d["kind"]: d for d in _docs(path)}["Deployment"]["spec"]["template"]["spec"]
    for c in pod["containers"]:
        cmd = c["command"]
        assert not [a for a in cmd if "lease" in a], c["name"]
        if "services.gateway" in cmd:
            assert _flag(cmd, "--verifier") and _flag(cmd, "--draft") is None, c["name"]


def _mps_pod() -> tuple[dict, dict[str, dict]]:
    docs = {d["kind"]: d for d in _docs(MPS)}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    return docs, {c["name"]: c for c in pod["containers"]}


def _gpus(container: dict) -> int:
    return container["resources"].get("limits", {}).get("nvidia.com/gpu", 0)


def test_mps_variant_runs_draft_and_verifier_in_containers_of_their_own():
    """Each service is a container running its own module (no stack); the draft and the verifier each request a GPU
    replica, the gateway none; the verifier dials the draft's container port on localhost and the gateway the
    verifier's; only the gateway's ports are in the NetworkPolicy and the Service."""
    docs, cs = _mps_pod()
    assert set(cs) == {"draft", "verifier", "gateway"}
    for name, c in cs.items():
        assert c["command"][:3] == ["python", "-m", f"services.{name}"], name
    assert {name: _gpus(c) for name, c in cs.items()} == {"draft": 1, "verifier": 1, "gateway": 0}
    ports = {name: {p["containerPort"] for p in c["ports"]} for name, c in cs.items()}
    listens = {name: int(_flag(c["command"], "--addr").rsplit(":", 1)[1]) for name, c in cs.items()}
    for name in cs:
        assert listens[name] in ports[name], name
    verifier, gateway = cs["verifier"]["command"], cs["gateway"]["command"]
    assert "--draft-here" not in verifier
    assert _flag(verifier, "--draft") == f"127.0.0.1:{listens['draft']}"
    assert _flag(gateway, "--verifier") == f"127.0.0.1:{listens['verifier']}"
    public = {p["port"] for rule in docs["NetworkPolicy"]["spec"]["ingress"] for p in rule["ports"]}
    assert public == ports["gateway"] and public.isdisjoint(ports["draft"] | ports["verifier"])
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"]} == ports["gateway"]


def test_mps_variant_lands_on_one_gpu():
    """The device plugin spreads a node's replicas over its GPUs, so only a node with one physical GPU puts the draft
    and the verifier on the same one: the pod asks for such a node, shared by MPS in as many replicas as it requests
    (it holds them all). The containers share the pod's IPC namespace (CUDA IPC) and leave /dev/shm to the plugin,
    which mounts the MPS daemon's there."""
    docs, cs = _mps_pod()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    selector = pod.get("nodeSelector", {})
    assert selector.get("nvidia.com/gpu.sharing-strategy") == "mps"
    assert selector.get("nvidia.com/gpu.count") == "1"
    assert selector.get("nvidia.com/gpu.replicas") == str(sum(map(_gpus, cs.values()))) == "2"
    assert not pod.get("hostIPC")
    mounts = [m["mountPath"] for c in cs.values() for m in c.get("volumeMounts", [])]
    assert "/dev/shm" not in mounts


def test_mps_variant_budgets_fit_starts_and_restarts_by_the_kubelet():
    """The containers start at once: the verifier waits for a draft still starting (its policy is calibrated with the
    draft's step times), the gateway listens only once the verifier answers; the gateway's liveness outlasts a
    verifier restarted by the kubelet (its back-off, then a start as long as the startup probes allow)."""
    _, cs = _mps_pod()
    draft_wait = float(_flag(cs["verifier"]["command"], "--draft-wait"))
    start = {name: _budget(c["startupProbe"]) for name, c in cs.items()}
    assert start["draft"] <= draft_wait
    assert start["verifier"] >= 2 * GRAPH_CAPTURE_S + draft_wait
    assert start["gateway"] >= start["verifier"]
    assert float(_flag(cs["gateway"]["command"], "--connect-timeout")) >= start["verifier"]
    assert _budget(cs["gateway"]["livenessProbe"]) >= KUBELET_BACKOFF_S + 2 * GRAPH_CAPTURE_S
