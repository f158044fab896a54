"""Each service's configuration is one frozen dataclass; its command line is generated from it, so a knob is
declared once (name, type, default, help, environment variable) and cannot disagree between layers.

    @dataclass(frozen=True)
    class DraftConfig(Serving, EngineKnobs):
        top_k: int = knob(10, "children kept per expanded node")

    DraftConfig.from_argv()   # --top-k 12 -> DraftConfig(top_k=12, ...)

Booleans are --x / --no-x; a knob with `env` takes its default from that environment variable when set.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")
_PARSE = {int: int, float: float, str: str}


def knob(default: Any, help: str, *, env: str = "", choices: tuple[str, ...] = ()) -> Any:
    """A configuration field that is also a command-line flag."""
    return dataclasses.field(default=default, metadata={"help": help, "env": env, "choices": choices})


def add_arguments(p: argparse.ArgumentParser, cls: type) -> None:
    """One flag per knob of `cls` (fields without help are not flags)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta:
            continue
        kind = hints[f.name]
        default = f.default
        if meta["env"] and meta["env"] in os.environ:
            default = _value(kind, os.environ[meta["env"]], f.name)
        flag = "--" + f.name.replace("_", "-")
        shown = f"{meta['help']} (default: {default!r}{', env ' + meta['env'] if meta['env'] else ''})"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=shown)
        else:
            p.add_argument(flag, type=_PARSE[kind], default=default, choices=meta["choices"] or None, help=shown)


def _value(kind: type, text: str, name: str) -> Any:
    if kind is bool:
        if text.lower() not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
            raise ValueError(f"{name}: {text!r} is not a boolean")
        return text.lower() in ("1", "true", "on", "yes")
    return _PARSE[kind](text)


def from_args(cls: type[T], ns: argparse.Namespace) -> T:
    """The config of the parsed flags (its __post_init__ validates; a ValueError names the bad knob)."""
    names = {f.name for f in dataclasses.fields(cls) if "help" in f.metadata}
    return cls(**{n: getattr(ns, n) for n in names})


def parse(cls: type[T], prog: str, description: str, argv: list[str] | None = None) -> T:
    """Parse the command line into `cls`, set up logging (a `log_level` knob), and return the config. A config
    that does not validate exits with argparse's usage error (status 2) naming what is wrong."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p, cls)
    ns = p.parse_args(argv)
    try:
        cfg = from_args(cls, ns)
    except ValueError as e:
        p.error(str(e))
    level = getattr(cfg, "log_level", "INFO")
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger(prog).info("configuration: %s", cfg)
    return cfg


@dataclasses.dataclass(frozen=True)
class Serving:
    """What every service takes: logging, the port file tests read, the drain on SIGTERM."""

    port_file: str = knob("", "write the bound port here once serving (tests start services on port 0)")
    log_level: str = knob("INFO", "log level", env="LOG_LEVEL")
    drain_grace: float = knob(
        20.0,
        "seconds in-flight work may take to finish after SIGTERM (keep it below the orchestrator's kill timeout, "
        "e.g. terminationGracePeriodSeconds)",
        env="DRAIN_GRACE",
    )

    def __post_init__(self) -> None:
        if self.drain_grace < 0:
            raise ValueError(f"drain_grace must be >= 0, got {self.drain_grace}")


@dataclasses.dataclass(frozen=True)
class EngineKnobs:
    """The engines' knobs (the verifier's, and the draft's in its own process)."""

    model: str = knob("", "GGUF file or Hugging Face folder ('' = $SPECDEC_GGUF or the embedded SmolLM2)")
    device: str = knob("cpu", "torch device: cpu, cuda, cuda:1", env="SPECDEC_DEVICE")
    dtype: str = knob(
        "auto", "auto: bfloat16 on CUDA, float32 on CPU", choices=("auto", "float32", "bfloat16", "float16")
    )
    graphs: bool = knob(True, "capture CUDA graphs at start-up (CUDA only)")
    max_sequences: int = knob(
        0, "sequences held at once; 0 = auto: 8 on CPU, from free GPU memory on CUDA (--gpu-memory-fraction), <= 64"
    )
    gpu_memory_fraction: float = knob(
        0.4, "share of the GPU memory free at start-up the KV cache may take when --max-sequences is auto"
    )
    max_context: int = knob(2048, "prompt + generated tokens per sequence")

    def __post_init__(self) -> None:
        if self.max_sequences < 0 or self.max_context < 16 or not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError("max_sequences must be >= 0, max_context >= 16, gpu_memory_fraction in (0, 1]")


@dataclasses.dataclass(frozen=True)
class DraftingKnobs:
    """The drafter's knobs (the draft service's, and the verifier's with --draft-here)."""

    drafter: str = knob("eagle3", "eagle3, or a test oracle", choices=("eagle3", "oracle-greedy", "oracle-wrong"))
    head: str = knob("", "EAGLE-3 head folder ('' = models/eagle3-smollm2, the head trained for SmolLM2)")
    top_k: int = knob(10, "children kept per expanded node (EAGLE-2 dynamic tree)")
    steps: int = knob(6, "tree levels drafted at most")
    verify_tree_size: int = knob(60, "nodes verified at most per tree")
    sampling_rule: str = knob(
        "onehot",
        "sampled requests: onehot (the top-k tree, each child a point mass; its rounds chain on the device) or q "
        "(children drawn from the draft's q, recursive rejection sampling)",
        choices=("q", "onehot"),
    )
    q_width: int = knob(32, "tokens of the draft's q kept per node under the q rule")
