"""The draft's same-host link (services/local_link.py): frames by hand, the draft's answers through its error
boundary, and the verifier's side (RemoteDrafter) mapping a link's errors as it maps gRPC's. A draft service process
answering on its link: tests/test_bench_draft_hop.py (the proposes), tests/test_faults.py (killed under load)."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest
import torch

from common.config import DraftingConfig
from common.errors import PeerUnavailable, UnknownSequence
from services import local_link
from services.draft.server import DraftServicer
from services.verifier.remote_draft import RemoteDrafter
from specdec.v1 import internal_pb2 as pb


def test_a_frame_is_its_kind_length_and_payload():
    a, b = socket.socketpair()
    with a, b:
        local_link.send_frame(a, local_link.RELEASE, b"xyz")
        assert b.recv(64) == b"\x02\x03\x00\x00\x00xyz"
        local_link.send_frame(a, 0, b"")
        local_link.send_frame(a, 7, bytes(range(200)) * 1000)  # longer than one recv
        assert local_link.recv_frame(b) == (0, b"")
        assert local_link.recv_frame(b) == (7, bytes(range(200)) * 1000)
        a.sendall(bytes((1,)) + (local_link.MAX_PAYLOAD + 1).to_bytes(4, "little"))  # over the limit: not read
        with pytest.raises(local_link.LinkClosed, match="over the limit"):
            local_link.recv_frame(b)
        a.sendall(b"\x01\x09\x00\x00\x00abc")  # 9 bytes announced, 3 sent, then closed
        a.close()
        with pytest.raises(local_link.LinkClosed):
            local_link.recv_frame(b)


def test_the_server_answers_each_connections_frames_in_order():
    seen = []

    def handle(kind: int, payload: bytes) -> tuple[int, bytes]:
        seen.append((kind, payload))
        return 0, payload[::-1]

    server = local_link.LinkServer(local_link.socket_name(f"test-{id(seen)}"), handle)
    try:
        one, two = (local_link.connect(server.name, 5.0) for _ in range(2))
        with one, two:
            for sock, msg in ((one, b"abc"), (two, b"de"), (one, b"f")):
                local_link.send_frame(sock, local_link.PROPOSE, msg)
                assert local_link.recv_frame(sock) == (0, msg[::-1])
        assert seen == [(1, b"abc"), (1, b"de"), (1, b"f")]
    finally:
        server.close()
    with pytest.raises(OSError):
        local_link.connect(server.name, 1.0)


class NoTrees:
    """A drafter that must never be reached: every request below is refused before it is."""

    name = "none"

    def step_costs(self):
        return []

    def release(self, seq_ids):
        return 0

    def propose(self, items):
        raise AssertionError("refused requests reach the drafter")


@pytest.fixture
def servicer():
    s = DraftServicer(NoTrees(), DraftingConfig(), hidden_width=6, vocab_size=100, device=torch.device("cpu"))
    yield s
    s.close()


def test_the_drafts_link_answers_as_its_grpc_methods(servicer):
    """Refusals come back with the status code gRPC would give and the details; a Release is answered."""
    code, details = servicer.link_call(local_link.PROPOSE, pb.ProposeRequest(owner="v").SerializeToString())
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], b"propose request has no items")
    bad_token = pb.ProposeRequest(owner="v", items=[pb.ProposeItem(seq_id="s", token_ids=[5, 100])])
    code, details = servicer.link_call(local_link.PROPOSE, bad_token.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"sequence 's'" in details and b"100" in details
    code, details = servicer.link_call(local_link.PROPOSE, b"\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and details.startswith(b"malformed request")
    code, details = servicer.link_call(9, b"")
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], b"unknown link method 9")
    code, out = servicer.link_call(local_link.RELEASE, pb.ReleaseRequest(seq_ids=["s"], owner="v").SerializeToString())
    assert code == local_link.OK and pb.ReleaseResponse.FromString(out).released == 0


def remote_on(link: socket.socket) -> RemoteDrafter:
    """A RemoteDrafter whose gRPC side answers nothing (port 1) and whose calls go to `link`."""
    r = RemoteDrafter("127.0.0.1:1", "v", 5.0, torch.device("cpu"), vocab_size=100)
    r.link = link
    return r


def test_the_verifier_maps_a_links_errors_as_grpcs():
    not_found, unavailable = grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.UNAVAILABLE.value[0]
    answers = iter([(not_found, b"no sequence 'x'"), (unavailable, b"")])
    server = local_link.LinkServer(local_link.socket_name(f"test-{id(answers)}"), lambda kind, payload: next(answers))
    try:
        r = remote_on(local_link.connect(server.name, 5.0))
        with pytest.raises(UnknownSequence, match="no sequence 'x'"):  # the draft did not restart: its own answer
            r.release(["x"])
        with pytest.raises(PeerUnavailable, match="UNAVAILABLE"):
            r.release(["x"])
        assert r.link is not None  # answers in turn: the link stays
        r.close()
    finally:
        server.close()


def test_a_link_that_breaks_mid_call_is_dropped_and_the_draft_unavailable():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = local_link.socket_name(f"test-{id(listener)}")
    listener.bind("\0" + name)
    listener.listen(1)

    def take_one_frame_and_close():
        conn, _ = listener.accept()
        with conn:
            local_link.recv_frame(conn)

    t = threading.Thread(target=take_one_frame_and_close)
    t.start()
    try:
        r = remote_on(local_link.connect(name, 5.0))
        with pytest.raises(PeerUnavailable, match="its link"):
            r.release(["a"])
        assert r.link is None  # the next calls go through gRPC until Info names a link again
        with pytest.raises(PeerUnavailable):  # gRPC: nobody on port 1
            r.release(["a"])
        r.close()
    finally:
        t.join(10)
        listener.close()


def test_after_a_broken_link_the_next_call_connects_again():
    """A link broken by a call (the draft stalled past the timeout, say) is dropped; the next call connects to the
    socket the draft's Info named and is answered there."""
    released = pb.ReleaseResponse(released=3).SerializeToString()
    server = local_link.LinkServer(local_link.socket_name(f"test-{id(released)}"), lambda kind, payload: (0, released))
    mine, theirs = socket.socketpair()
    try:
        r = remote_on(mine)
        r.info = pb.DraftInfoResponse(link_socket=server.name, host_id=socket.gethostname())
        theirs.close()
        with pytest.raises(PeerUnavailable, match="its link"):
            r.release(["a"])
        assert r.release(["a"]) == 3 and r.link is not None
        r.close()
    finally:
        server.close()
