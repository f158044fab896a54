"""The draft's same-host link: a verifier's Propose and Release calls to a draft service on its own host over a Unix
socket (Linux's abstract namespace: no file to clean up), one frame each way, instead of a gRPC call. Info,
ImportBuffer and health stay on gRPC, and so does a draft on another host or one whose socket cannot be reached (a
container of another network namespace): RemoteDrafter falls back to gRPC by itself.

Why: a unary gRPC call from Python costs 0.6-0.9 ms of round trip on the project's machines (a bare Info to the draft
service: 744 us median on an H200 host, 876 us on the 2-core CPU), and the hop sits on every round of the
three-process stack (a round of the colocated one: 1.5 ms). `bench.draft_hop --device cuda --mps` on an H200: a
propose's round trip less the draft's compute 1,354 us through gRPC, 344 us over this link. The messages are the gRPC
methods' own protobufs, and the draft runs them through the same error boundary (services/draft/server.py's
engine_call).

A frame: 1 byte (a request: its method, PROPOSE or RELEASE; a reply: 0 for OK, else the gRPC status code's number),
the payload's length (4 bytes, little-endian), the payload (a request or response serialized; an error's details in
UTF-8). Example: Release of ["a"] by "v" is b"\\x02" + (12).to_bytes(4, "little") + ReleaseRequest(seq_ids=["a"],
owner="v").SerializeToString()."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

from common.rpc import MAX_MESSAGE_BYTES

PROPOSE, RELEASE = 1, 2
OK = 0
_HEADER = 5
MAX_PAYLOAD = MAX_MESSAGE_BYTES  # gRPC's limit on the same messages: a longer frame closes the connection


class LinkClosed(ConnectionError):
    """The other side closed the socket (between frames or within one)."""


def socket_name(instance_id: str) -> str:
    """The abstract socket a draft instance listens on (a restarted draft gets a new one)."""
    return f"specdec-draft-{instance_id}"


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise LinkClosed("the socket closed")
        got += k
    return bytes(buf)


def send_frame(sock: socket.socket, kind: int, payload: bytes) -> None:
    sock.sendall(bytes((kind,)) + len(payload).to_bytes(4, "little") + payload)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    """(kind, payload) of the next frame; LinkClosed when the socket closes first or the frame is over MAX_PAYLOAD
    (its bytes are not read: the connection is of no further use)."""
    header = _recv_exactly(sock, _HEADER)
    n = int.from_bytes(header[1:], "little")
    if n > MAX_PAYLOAD:
        raise LinkClosed(f"a frame of {n} bytes, over the limit of {MAX_PAYLOAD}")
    return header[0], _recv_exactly(sock, n)


def connect(name: str, timeout_s: float) -> socket.socket:
    """A connection to the abstract socket `name` whose calls time out after timeout_s (OSError when none listens)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + name)
    except OSError:
        sock.close()
        raise
    return sock


class LinkServer:
    """Listens on the abstract socket `name`; each connection gets a thread that answers its frames in order with
    handle(kind, payload) -> (reply kind, payload)."""

    def __init__(self, name: str, handle: Callable[[int, bytes], tuple[int, bytes]]) -> None:
        self.name, self._handle = name, handle
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + name)
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(8)
        threading.Thread(target=self._accept, name="draft-link", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="draft-link-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    kind, payload = recv_frame(conn)
                except OSError:  # the caller went away (LinkClosed) or the socket broke
                    return
                reply, out = self._handle(kind, payload)
                try:
                    send_frame(conn, reply, out)
                except OSError:
                    return

    def close(self) -> None:
        with contextlib.suppress(OSError):  # not connected: nothing to shut down
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._sock.close()
