"""What a round's trees cost on the wire in Python: a VerifyRequest of B trees of N nodes built, serialized,
parsed and converted to numpy, with DraftTree's packed bytes (services/tree_wire.py) against the same
arrays as repeated int32/float fields (DraftTree's layout before packing, rebuilt here as a message).

    python -m bench.tree_wire [--batch 64] [--nodes 60] [--reps 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from services.tree_wire import draft_tree, unpack
from specdec.v1 import internal_pb2 as pb


def _repeated_request_class():
    """A message {repeated Item items} with Item {string seq_id; repeated int32 token_ids, parents;
    repeated float draft_probs}: the previous DraftTree inside a VerifyItem, flattened."""
    f = descriptor_pb2.FileDescriptorProto(name="bench_tree_wire.proto", package="bench", syntax="proto3")
    item = f.message_type.add(name="Item")
    t = descriptor_pb2.FieldDescriptorProto
    item.field.add(name="seq_id", number=1, type=t.TYPE_STRING, label=t.LABEL_OPTIONAL)
    for i, (name, kind) in enumerate((("token_ids", t.TYPE_INT32), ("parents", t.TYPE_INT32)), start=2):
        item.field.add(name=name, number=i, type=kind, label=t.LABEL_REPEATED)
    item.field.add(name="draft_probs", number=4, type=t.TYPE_FLOAT, label=t.LABEL_REPEATED)
    req = f.message_type.add(name="Request")
    req.field.add(name="items", number=1, type=t.TYPE_MESSAGE, label=t.LABEL_REPEATED, type_name=".bench.Item")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Request"))


def measure(batch: int, nodes: int, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, nodes)
    parents = np.arange(-1, nodes - 1)
    probs = rng.random(nodes).astype(np.float32)
    repeated = _repeated_request_class()

    def packed_round():
        req = pb.VerifyRequest()
        for i in range(batch):  # the draft: numpy -> bytes
            req.items.add(seq_id=f"gw.0-{i}", tree=draft_tree(tokens, parents, probs))
        back = pb.VerifyRequest.FromString(req.SerializeToString())
        return [unpack(it.tree) for it in back.items]  # the verifier: bytes -> numpy

    def repeated_round():
        req = repeated()
        for i in range(batch):
            it = req.items.add(seq_id=f"gw.0-{i}")
            it.token_ids.extend(tokens.tolist())
            it.parents.extend(parents.tolist())
            it.draft_probs.extend(probs.tolist())
        back = repeated.FromString(req.SerializeToString())
        return [
            (np.asarray(list(it.token_ids)), np.asarray(list(it.parents)), np.asarray(list(it.draft_probs)))
            for it in back.items
        ]

    out = {}
    for name, fn in (("packed", packed_round), ("repeated", repeated_round)):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = (time.perf_counter() - t0) / reps * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=60)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    ms = measure(a.batch, a.nodes, a.reps)
    for name, v in ms.items():
        print(f"{name}: {v:.3f} ms per round of {a.batch} trees x {a.nodes} nodes (build, serialize, parse, convert)")


if __name__ == "__main__":
    main()
