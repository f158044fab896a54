"""SamplingParams on the wire <-> SamplingConfig: the one conversion the gateway (sending) and the draft and
the verifier (receiving) share."""

from __future__ import annotations

from common.config import SamplingConfig
from common.errors import InvalidRequest
from specdec.v1 import internal_pb2 as pb


def sampling_msg(s: SamplingConfig) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed or 0, has_seed=s.seed is not None
    )


def sampling_config(msg: pb.SamplingParams) -> SamplingConfig:
    """Raises InvalidRequest for parameters SamplingConfig refuses."""
    try:
        return SamplingConfig(
            temperature=msg.temperature,
            top_p=msg.top_p or 1.0,
            top_k=msg.top_k,
            seed=msg.seed if msg.has_seed else None,
        )
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
