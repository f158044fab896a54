"""Tokenizer, chat template and incremental detokenization, without torch.

Encoding and decoding use the `tokenizers` library (Rust) and chat templates render with jinja2
(common.chat_template), so the gateway never imports transformers or torch. What they read is an *export* of
transformers' own tokenizer for the model: tokenizer.json, chat_template.jinja and specdec_tokenizer.json (ids and
flags transformers resolved). Making it needs transformers, whose GGUF reader imports torch, so it runs once, in a
child process, and is cached under $XDG_CACHE_HOME/specdec/tokenizers/<key>/ (~/.cache by default); the key names
the model file's path, size and mtime and the transformers version.

    python -m common.tokenizer export [--model PATH] [--out DIR]

exports ahead of time (default: the embedded model, into that cache). A folder holding an export can be given to
Tokenizer as it is (e.g. as the gateway's --model), with no transformers installed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tokenizers

from common.chat_template import ChatTemplate
from common.errors import InvalidRequest
from common.model_path import cache_root

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
META_FILE = "specdec_tokenizer.json"
EXPORT_FORMAT = 1  # part of the cache key: bump when an export's contents change
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TokenizerMeta:
    """What transformers resolved besides tokenizer.json and the chat template (META_FILE in an export)."""

    eos_token_id: int
    bos_token_id: int | None
    vocab_size: int  # with added tokens: len(AutoTokenizer)
    special_tokens: dict[str, str]  # named special tokens the template sees: {"eos_token": "<|im_end|>", ...}
    split_special_tokens: bool = False  # encode a special token's text as plain text
    clean_up_tokenization_spaces: bool = False  # as decode applies it (transformers never does for BPE)
    source: str = ""  # the model file or folder exported (for people reading the cache)

    def __post_init__(self) -> None:
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is outside the vocabulary [0, {self.vocab_size})")

    @classmethod
    def read(cls, folder: Path) -> TokenizerMeta:
        return cls(**json.loads((folder / META_FILE).read_text(encoding="utf-8")))


class Tokenizer:
    """Encodes and decodes exactly as transformers' AutoTokenizer does for the same GGUF file or HF folder."""

    def __init__(self, path: Path) -> None:
        folder = cached_export(Path(path))
        meta = TokenizerMeta.read(folder)
        self._tok = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        self._tok.no_padding()  # transformers switches both off for every unpadded, untruncated call
        self._tok.no_truncation()
        self._tok.encode_special_tokens = meta.split_special_tokens
        template = folder / TEMPLATE_FILE
        self._template = (
            ChatTemplate(template.read_text(encoding="utf-8"), meta.special_tokens) if template.is_file() else None
        )
        self._clean_up = meta.clean_up_tokenization_spaces
        self.eos_token_id: int = meta.eos_token_id
        self.vocab_size: int = meta.vocab_size
        # the longest token, special ones included, in characters of its vocabulary entry: an upper bound of the
        # characters one token stands for (a byte-level BPE entry has one character per byte, and a text's
        # characters are at most its bytes), so a text of n characters has at least n / max_token_chars tokens.
        # SmolLM2: 81 ("\n" and 80 spaces)
        self.max_token_chars: int = max(map(len, self._tok.get_vocab(with_added_tokens=True)))

    def encode_prompt(self, prompt: str) -> list[int]:
        return self._tok.encode(prompt, add_special_tokens=False).ids

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """messages: (role, content) pairs; the template's generation prompt is appended."""
        for role, _ in messages:
            if role not in ROLES:
                raise InvalidRequest(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
        if self._template is None:
            raise InvalidRequest("this model has no chat template: send a raw prompt instead")
        text = self._template.render([{"role": r, "content": c} for r, c in messages], add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False).ids  # the template wrote the special tokens

    def encode_turn_prefix(self, role: str = "user") -> list[int]:
        """The template up to and including the start of a first `role` turn (after the default system prompt,
        where the template adds one): what Magpie feeds the model to have it write that turn. The template is
        rendered around a marker content and cut there, so this is the text encode_chat's prompts start with.
        SmolLM2: "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\n<|im_start|>user\n".
        """
        if role not in ROLES:
            raise InvalidRequest(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
        if self._template is None:
            raise InvalidRequest("this model has no chat template: it has no turns to start")
        marker = "\x00specdec-turn-content\x00"
        text = self._template.render([{"role": role, "content": marker}], add_generation_prompt=False)
        if text.count(marker) != 1:
            raise InvalidRequest(f"the chat template does not render a {role} turn's content verbatim")
        return self._tok.encode(text[: text.index(marker)], add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        text = self._tok.decode(ids, skip_special_tokens=True)
        return _clean_up_tokenization(text) if self._clean_up else text

    def tokens(self, ids: list[int]) -> list[str]:
        return [str(self._tok.id_to_token(int(i))) for i in ids]


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
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


def cached_export(model: Path) -> Path:
    """The folder of `model`'s export: `model` itself if it is one, else its cache folder, exported on first use in
    a child process (transformers, and with it torch, stays out of this one)."""
    if (model / META_FILE).is_file():
        return model
    out = cache_dir(model)
    if not (out / META_FILE).is_file():
        log.info("exporting the tokenizer of %s to %s (once, in a child process)", model, out)
        cmd = [sys.executable, "-m", "common.tokenizer", "export", "--model", str(model.resolve()), "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"exporting the tokenizer of {model} failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
            )
    return out


def cache_dir(model: Path) -> Path:
    """$XDG_CACHE_HOME/specdec/tokenizers/<stem>-<key>: the key changes with the model file (for a folder: the files
    directly in it), its path, the transformers version and EXPORT_FORMAT."""
    model = model.resolve()
    files = sorted(p for p in model.iterdir() if p.is_file()) if model.is_dir() else [model]
    key = hashlib.sha256(f"{EXPORT_FORMAT}\0{_transformers_version()}\0{model}".encode())
    for f in files:
        st = f.stat()
        key.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return cache_root() / "tokenizers" / f"{model.stem}-{key.hexdigest()[:16]}"


def export(model: Path, out: Path) -> None:
    """Save transformers' tokenizer for `model` (GGUF file or HF folder) as an export in `out`. It is written to a
    temporary folder beside `out` and renamed, so a reader never sees half of one and concurrent exports are safe."""
    from transformers import AutoTokenizer

    if model.is_dir():
        tok = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name, local_files_only=True)
    if not tok.is_fast:
        raise ValueError(f"{model}: transformers loaded a {type(tok).__name__}, which has no `tokenizers` backend")
    if tok.eos_token_id is None:
        raise ValueError(f"{model}: the tokenizer has no end-of-sequence token")
    backend = tok.backend_tokenizer
    # transformers' decode skips the clean-up for BPE models unless this flag forces it
    force = getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    meta = TokenizerMeta(
        eos_token_id=int(tok.eos_token_id),
        bos_token_id=None if tok.bos_token_id is None else int(tok.bos_token_id),
        vocab_size=len(tok),
        special_tokens=dict(tok.special_tokens_map),
        split_special_tokens=bool(tok.split_special_tokens),
        clean_up_tokenization_spaces=bool(tok.clean_up_tokenization_spaces)
        and (type(backend.model).__name__ != "BPE" or bool(force)),
        source=str(model),
    )
    try:
        template = tok.get_chat_template()  # the one apply_chat_template uses without tools
    except ValueError:
        template = None  # none, or several without a default
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        backend.save(str(tmp / TOKENIZER_FILE))
        if template is not None:
            (tmp / TEMPLATE_FILE).write_text(template, encoding="utf-8")
        (tmp / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n", encoding="utf-8")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / META_FILE).is_file():  # else another process exported the same model first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _clean_up_tokenization(text: str) -> str:
    """transformers' PreTrainedTokenizerBase.clean_up_tokenization (WordPiece-era spacing before punctuation)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


def main(argv: list[str] | None = None) -> None:
    from common.model_path import default_model_path

    p = argparse.ArgumentParser(
        prog="python -m common.tokenizer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export a model's tokenizer (needs transformers)")
    e.add_argument(
        "--model", default=None, help="GGUF file or HF folder (default: $SPECDEC_GGUF or the embedded SmolLM2)"
    )
    e.add_argument("--out", default=None, help="folder to create (default: the cache folder Tokenizer reads)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = Path(a.model) if a.model else default_model_path()
    out = Path(a.out) if a.out else cache_dir(model)
    export(model, out)
    log.info("exported the tokenizer of %s to %s", model, out)


if __name__ == "__main__":
    main()
