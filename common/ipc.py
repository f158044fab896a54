"""CUDA IPC between the verifier and a draft service on the same GPU: the verifier exports one hidden-state buffer
once, the draft maps it, and each propose carries only region references (buffer, offset, shape, dtype).

Synchronisation (why the draft never reads a half-written or reused region):
1. Each sequence owns one region of the buffer (`HiddenExport`), so writers of different sequences never
   overlap. The verifier's engine core writes a propose's features there and synchronises its stream before
   it sends the propose: when a reference leaves the verifier, the bytes are complete in device memory.
2. The draft copies the rows into its own tensors and synchronises its stream before it answers.
3. The core calls the draft synchronously, so the next write to a region (that sequence's next propose)
   comes after that answer. A released sequence's region is reused only by a later sequence.
The `round` in each reference counts the region's writes; it is logged on mismatch for diagnosis, the ordering
above is what guarantees correctness.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from common.errors import InvalidRequest
from common.slots import SlotTable

log = logging.getLogger(__name__)


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID, or "" for a CPU device (no IPC then)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def _check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


@dataclass(frozen=True)
class ExportedBuffer:
    buffer_id: str
    handle: bytes  # 64-byte cudaIpcMemHandle_t of the allocation that holds the buffer
    offset_bytes: int  # where the buffer starts inside that allocation
    nbytes: int


def export_buffer(t: torch.Tensor) -> ExportedBuffer:
    """IPC handle of the allocation holding `t` (PyTorch's allocator may place it inside a larger
    segment: the handle names the segment's base and we send the offset)."""
    from cuda.bindings import driver, runtime

    torch.cuda.synchronize(t.device)
    ptr = t.data_ptr()
    base, _size = _check(driver.cuMemGetAddressRange(ptr))
    handle = _check(runtime.cudaIpcGetMemHandle(int(base)))
    return ExportedBuffer(
        buffer_id=uuid.uuid4().hex,
        handle=bytes(handle.reserved),
        offset_bytes=ptr - int(base),
        nbytes=t.numel() * t.element_size(),
    )


def _unexported(t: torch.Tensor) -> ExportedBuffer:
    """A buffer's description without an IPC handle (a CPU buffer: nothing else can map it)."""
    return ExportedBuffer(buffer_id=uuid.uuid4().hex, handle=b"", offset_bytes=0, nbytes=t.numel() * t.element_size())


class _DevicePointer:
    """Presents a raw device pointer to torch.as_tensor through __cuda_array_interface__."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def map_buffer(exp: ExportedBuffer, device: torch.device) -> torch.Tensor:
    """Map a buffer exported by another process: [nbytes] uint8 on `device`, no copy."""
    from cuda.bindings import runtime

    handle = runtime.cudaIpcMemHandle_t()
    handle.reserved = exp.handle
    with torch.cuda.device(device):
        ptr = _check(runtime.cudaIpcOpenMemHandle(handle, runtime.cudaIpcMemLazyEnablePeerAccess))
    return torch.as_tensor(_DevicePointer(int(ptr) + exp.offset_bytes, exp.nbytes), device=device)


@dataclass
class _Region:
    writes: int = 0


class HiddenExport:
    """The verifier's exported hidden-state buffer: one region of `rows` rows per sequence.

    buffer: [regions, rows, width] in the engine's dtype
    """

    def __init__(self, regions: int, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = torch.zeros(regions, rows, width, dtype=dtype, device=device)
        self.table: SlotTable[_Region] = SlotTable(regions)
        # a CPU buffer has no IPC handle: the same bookkeeping, for CPU tests
        self.exported = export_buffer(self.buffer) if self.buffer.is_cuda else _unexported(self.buffer)
        self.flat = self.buffer.view(regions * rows, width)  # [regions * rows, width] the same memory
        self.row_bytes = width * self.buffer.element_size()
        self.rows = rows
        self.unwaited = False  # copies were queued since the last wait()

    def write(self, seq_id: str, hidden: torch.Tensor, row: int = 0) -> tuple[int, int]:
        """Copy hidden [k, width] into the sequence's region from row `row` on (rows before it hold
        features the draft has yet to read: a plain round's, see DecodeItem.hidden_row); the caller
        wait()s once after its writes. Returns (offset in bytes of the written rows, write count)."""
        return self.write_many([seq_id], hidden, [hidden.shape[0]], [row])[0]

    def write_many(
        self, seq_ids: list[str], hidden: torch.Tensor, counts: list[int], rows: list[int] | None = None
    ) -> list[tuple[int, int]]:
        """write() of several distinct sequences in one copy: hidden [sum(counts), width] holds their rows
        one sequence after the other, counts[i] of them for seq_ids[i], written from row rows[i] (all 0
        when None) of its region. Every range is checked before anything is written. Returns (offset,
        write count) of each sequence, as write() does.
        Example: 4 rows a region; a in region 2, b in region 0; counts [2, 1], rows [1, 0]
                 hidden rows [a0, a1, b0] -> rows [2 * 4 + 1, 2 * 4 + 2, 0 * 4 + 0] = [9, 10, 0] of the
                 buffer flattened over its regions"""
        rows = rows if rows is not None else [0] * len(seq_ids)
        if not len(seq_ids) == len(counts) == len(rows) or sum(counts) != hidden.shape[0]:
            raise ValueError(
                f"{len(seq_ids)} sequences, {len(counts)} counts, {len(rows)} rows, {hidden.shape[0]} hidden rows"
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("write_many names a sequence twice (its rows would race)")
        for row, k in zip(rows, counts):
            if row < 0 or row + k > self.rows:
                raise InvalidRequest(f"hidden rows [{row}, {row + k}) exceed the exported region of {self.rows}")
        states = [self._region(s) for s in seq_ids]
        first = [region * self.rows + row for (region, _), row in zip(states, rows)]  # [K] flat row of each
        if len(seq_ids) == 1:  # one range: a plain copy (the index below would cost an upload and a kernel)
            self.flat[first[0] : first[0] + counts[0]].copy_(hidden)  # complete once wait() returns
        else:
            # each hidden row's buffer row: its sequence's first row, plus its place among that sequence's rows
            dst = np.repeat(np.array(first) - (np.cumsum(counts) - counts), counts) + np.arange(hidden.shape[0])
            # from pageable memory: staged before the call returns, so dst may go at once
            index = torch.from_numpy(dst).to(self.buffer.device, non_blocking=True)  # [sum(counts)]
            self.flat.index_copy_(0, index, hidden.to(device=self.buffer.device, dtype=self.buffer.dtype))
        self.unwaited = True
        placed = []
        for f, (_, state) in zip(first, states):
            state.writes += 1
            placed.append((f * self.row_bytes, state.writes))
        return placed

    def _region(self, seq_id: str) -> tuple[int, _Region]:
        """The sequence's region, taken on its first write."""
        try:
            return self.table.get(seq_id)
        except KeyError:
            self.table.acquire(seq_id, _Region())
            return self.table.get(seq_id)

    def wait(self) -> None:
        """Block until every write so far is in device memory: once per call, before it answers. Nothing to
        wait for when nothing was written since the last wait (a round whose outcomes the draft in this
        process took over: the host's synchronisation would only hold up the draft's next launch)."""
        if self.buffer.is_cuda and self.unwaited:  # CPU copies are complete when they return
            torch.cuda.current_stream(self.buffer.device).synchronize()
        self.unwaited = False

    def release(self, seq_id: str) -> None:
        self.table.release(seq_id)


class MappedBuffers:
    """The draft's side: buffers mapped from the verifier, by id."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def add(self, exp: ExportedBuffer) -> None:
        self.buffers[exp.buffer_id] = map_buffer(exp, self.device)

    def add_local(self, buffer_id: str, buffer: torch.Tensor) -> None:
        """A buffer of this very process (draft and verifier colocated: CUDA refuses to open a process's
        own IPC handle), read in place as the mapped ones are."""
        self.buffers[buffer_id] = buffer.reshape(-1).view(torch.uint8)

    def view(self, buffer_id: str, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(buffer_id)
        if buf is None:
            raise InvalidRequest(f"tensor refers to unknown IPC buffer {buffer_id!r}")
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or offset + nbytes > buf.numel():
            raise InvalidRequest(f"IPC region [{offset}, {offset + nbytes}) is outside the buffer")
        return buf[offset : offset + nbytes].view(dtype).view(shape)
