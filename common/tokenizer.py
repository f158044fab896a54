"""Tokenizer, chat template and incremental detokenization, read from the same model file."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import InvalidRequest

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")


class Tokenizer:
    """Wraps a transformers tokenizer loaded from a GGUF file or an HF folder (never from a hub)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer

        if path.is_dir():
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:
            self._tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      local_files_only=True)
        self.eos_token_id: int = int(self._tok.eos_token_id)
        self.vocab_size = len(self._tok)

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self._tok.encode(prompt, add_special_tokens=False))

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """messages: (role, content) pairs; the template's generation prompt is appended."""
        for role, _ in messages:
            if role not in ROLES:
                raise InvalidRequest(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
        if self._tok.chat_template is None:
            raise InvalidRequest("this model has no chat template: send a raw prompt instead")
        out = self._tok.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                            add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def tokens(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(ids)]


@dataclass
class IncrementalDecoder:
    """Emits text as tokens arrive without splitting multi-byte characters (the prefix/read offset
    scheme of vLLM and TGI): decode a short window and emit only what is new and complete."""

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)  # [completion_tokens]
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""
