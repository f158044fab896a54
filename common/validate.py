"""Checks of internal-API input at the service boundary, before an engine sees it: a bad token id would
index out of range (on CUDA, a device-side assert that takes the process down), a NaN hidden state
would silently poison a sequence. Each raises InvalidRequest (INVALID_ARGUMENT). Importing this module
loads no torch (the gateway checks token ids with it too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.errors import InvalidRequest

if TYPE_CHECKING:
    import torch


def token_ids(ids: list[int], vocab_size: int, what: str) -> None:
    """Every id in [0, vocab_size)."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InvalidRequest(f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def hidden_rows(hidden: torch.Tensor, width: int, rows: int, what: str) -> None:
    """hidden [rows, width], floating point (any float dtype converts losslessly enough to the engine's)."""
    if not hidden.dtype.is_floating_point:
        raise InvalidRequest(f"{what}: hidden states must be floating point, got {hidden.dtype}")
    if hidden.dim() != 2 or hidden.shape[1] != width:
        raise InvalidRequest(f"{what}: hidden must be [num_new, {width}], got {list(hidden.shape)}")
    if hidden.shape[0] != rows or rows == 0:
        raise InvalidRequest(f"{what}: {rows} new tokens but {hidden.shape[0]} hidden rows")


def all_finite(tensors: list[torch.Tensor], names: list[str]) -> None:
    """No NaN or infinity in any tensor: one device sync for the whole batch."""
    if not tensors:
        return
    import torch

    ok = torch.stack([torch.isfinite(t).all() for t in tensors]).cpu().tolist()
    for name, good in zip(names, ok):
        if not good:
            raise InvalidRequest(f"{name}: hidden states contain NaN or infinity")
