"""Short int32 lists on the wire as packed little-endian bytes (VerifyItem.stop_ids, VerifyResult.round_accepted
and round_nodes): one bytes field instead of a repeated one. No numpy: the gateway packs and unpacks these
too, and imports neither numpy nor torch (trees, which only the draft and the verifier read, go through
services/tree_wire.py).
Example: [1, 258] <-> b"\\x01\\x00\\x00\\x00\\x02\\x01\\x00\\x00"."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

from common.errors import InvalidRequest


def pack_ints(values: Iterable[int]) -> bytes:
    a = array("i", values)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_ints(data: bytes, what: str) -> list[int]:
    """pack_ints' inverse; InvalidRequest when `data` is not whole int32s (`what` names the field)."""
    if len(data) % 4:
        raise InvalidRequest(f"{what} is {len(data)} bytes, not a whole number of 4-byte values")
    a = array("i")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()
