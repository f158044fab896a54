"""TensorRef: how tensors cross services. Inline bytes now; a CUDA IPC region variant plugs in here."""

from __future__ import annotations

import numpy as np
import torch

from common.errors import InvalidRequest

_TORCH = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
_NAMES = {v: k for k, v in _TORCH.items()}
MAX_INLINE_BYTES = 256 << 20
MAX_DIMS = 4


def checked_shape(msg) -> tuple[tuple[int, ...], torch.dtype, int]:
    """A TensorRef's (shape, dtype, nbytes), refused with InvalidRequest before anything is allocated:
    unknown dtype, too many or negative dims, or a size past MAX_INLINE_BYTES. The size is computed in
    Python integers, so [2**32, 2**32] is 2**64 elements (too large), not 0 as an int64 product wraps."""
    dtype = _TORCH.get(msg.dtype)
    if dtype is None:
        raise InvalidRequest(f"unknown tensor dtype {msg.dtype!r}")
    shape = tuple(int(s) for s in msg.shape)
    if len(shape) > MAX_DIMS or any(s < 0 for s in shape):
        raise InvalidRequest(f"tensor shape {list(shape)} is invalid (at most {MAX_DIMS} dims, none negative)")
    nbytes = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        nbytes *= s
    if nbytes > MAX_INLINE_BYTES:
        raise InvalidRequest(f"tensor of shape {list(shape)} ({nbytes} bytes) exceeds {MAX_INLINE_BYTES} bytes")
    return shape, dtype, nbytes


def encode_ipc(t: torch.Tensor, msg, buffer_id: str, offset_bytes: int, round_: int) -> None:
    """Fill a TensorRef with a reference to rows already written to an exported buffer."""
    msg.shape[:] = list(t.shape)
    msg.dtype = _NAMES[t.dtype]
    msg.ipc.buffer_id = buffer_id
    msg.ipc.offset_bytes = offset_bytes
    msg.ipc.round = round_


def encode_inline(t: torch.Tensor, msg) -> None:
    """Fill a specdec.v1.TensorRef message with t's bytes (moved to host, C-contiguous)."""
    t = t.detach().contiguous()
    name = _NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot cross services")
    host = t.cpu()
    raw = host.view(torch.int16) if t.dtype == torch.bfloat16 else host  # numpy has no bfloat16
    msg.shape[:] = list(t.shape)
    msg.dtype = name
    msg.inline_data = raw.numpy().tobytes()


def decode(msg, device: torch.device | str, mapped=None) -> torch.Tensor:
    """Any TensorRef -> tensor on `device`. IPC references need the receiver's MappedBuffers and
    return a view into the mapped buffer (no copy)."""
    if msg.WhichOneof("payload") == "ipc":
        if mapped is None:
            raise InvalidRequest("tensor is an IPC reference but no IPC buffer is mapped here")
        shape, dtype, _ = checked_shape(msg)
        return mapped.view(msg.ipc.buffer_id, msg.ipc.offset_bytes, shape, dtype)
    return decode_inline(msg, device)


def decode_inline(msg, device: torch.device | str = "cpu") -> torch.Tensor:
    """Read a TensorRef carrying inline bytes back into a tensor on `device`."""
    if msg.WhichOneof("payload") != "inline_data":
        raise InvalidRequest("tensor payload is not inline bytes (CUDA IPC is not set up on this link)")
    shape, dtype, expected = checked_shape(msg)
    if expected != len(msg.inline_data):
        raise InvalidRequest(
            f"tensor of shape {shape} and dtype {msg.dtype} needs {expected} bytes, got {len(msg.inline_data)}"
        )
    np_dtype = np.int16 if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype
    arr = np.frombuffer(msg.inline_data, dtype=np_dtype).reshape(shape)
    t = torch.from_numpy(arr.copy())
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device)
