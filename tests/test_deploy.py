"""The Kubernetes manifests: valid against the API schemas offline (kubernetes-validate --strict), and
deployable as the services need: probes reach every container (no service bound to loopback where a
probe dials the pod IP), a drain fits in the termination grace, internal ports are closed by a
NetworkPolicy, metrics are exposed, a PodDisruptionBudget exists, and a GPU variant requests the GPU."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

MANIFESTS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "k8s").glob("*.yaml"))
PUBLIC_PORTS = {50051, 9090}


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
