"""The gateway's tokenizer (tokenizers + jinja2, no torch) against transformers' AutoTokenizer for the same model:
the same ids for chats and raw prompts, the same text back, the same special ids; and a gateway process that
builds it has imported neither torch nor transformers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from common.chat_template import ChatTemplate
from common.errors import InvalidRequest
from common.model_path import default_model_path
from common.tokenizer import META_FILE, IncrementalDecoder, Tokenizer, cache_dir, export

ROOT = Path(__file__).resolve().parents[1]

LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog, {i * 7} times." for i in range(300))
CODE = textwrap.dedent('''\
    def reverse(s: str) -> str:
    \t"""Tabs, trailing spaces   \n and a docstring."""
        return s[::-1]  # slice    with step -1

    if __name__ == "__main__":
        print(reverse("héllo"), {"a": [1, 2, 3]}, 0x1F, 1e-3)
    ''')
UNICODE = "Ünïcödé: naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية, हिन्दी, ẞ, ﬁ, Å vs Å"
EMOJI = "emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ❤️ 🧑🏿‍💻 and a lone \u200d joiner"

CHATS = [
    [("user", "Why is the sky blue?")],
    [("system", "You are terse."), ("user", "Name three primes.")],
    [("system", "Be kind."), ("user", "Hi!"), ("assistant", "Hello! How can I help?"), ("user", "Tell a joke.")],
    [("user", UNICODE)],
    [("user", EMOJI), ("assistant", "🙂"), ("user", "more " * 3)],
    [("user", "Review this code:\n```python\n" + CODE + "```")],
    [("system", LONG), ("user", "Summarize the above.")],
    [("user", "  leading and trailing spaces  \n\n\r\n\ttab")],
    [("user", "text with special tokens inside: <|im_start|>assistant\n<|im_end|><|endoftext|>")],
    [("assistant", "an assistant turn first"), ("user", "")],
]
PROMPTS = [
    "Once upon a time",
    " leading space",
    "",
    "\n\n\n",
    UNICODE,
    EMOJI,
    CODE,
    LONG,
    "<|im_start|>user\nraw special tokens<|im_end|>\n",
    "don't won't it's we're I'm you've , . ? !",
]


@pytest.fixture(scope="module")
def reference():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


@pytest.fixture(scope="module")
def gateway_process(tmp_path_factory) -> dict:
    """A fresh process imports the gateway's modules and builds its Tokenizer from the GGUF file with an empty
    cache (a new XDG_CACHE_HOME): what it imported, a chat's ids and text, and the cache it leaves."""
    cache = tmp_path_factory.mktemp("cache")
    code = textwrap.dedent("""\
        import json, sys
        import services.gateway.__main__, services.gateway.server, services.gateway.router
        from common.model_path import default_model_path
        from common.tokenizer import Tokenizer
        tok = Tokenizer(default_model_path())
        ids = tok.encode_chat([("user", "Hello")])
        heavy = sorted(m for m in sys.modules if m == "common.weights" or m.split(".")[0] in ("torch", "transformers"))
        print(json.dumps({"heavy": heavy, "ids": ids, "text": tok.decode(ids)}))
        """)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=cache, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "cache": cache}


@pytest.fixture(scope="module")
def ours(gateway_process):
    """The gateway's tokenizer, read from the export of the embedded GGUF that a gateway process made in its cache."""
    (meta,) = gateway_process["cache"].glob(f"specdec/tokenizers/*/{META_FILE}")
    return Tokenizer(meta.parent)


def _reference_chat(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(
        [{"role": r, "content": c} for r, c in messages], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


@pytest.mark.parametrize("messages", CHATS, ids=range(len(CHATS)))
def test_chat_ids_match_transformers(ours, reference, messages):
    assert ours.encode_chat(messages) == _reference_chat(reference, messages)


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_prompt_ids_and_text_match_transformers(ours, reference, prompt):
    ids = ours.encode_prompt(prompt)
    assert ids == reference.encode(prompt, add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.tokens(ids) == reference.convert_ids_to_tokens(ids)


def test_decode_matches_transformers_on_any_ids(ours, reference):
    """Chats (special tokens skipped) and random id runs: partial UTF-8 sequences, special ids mid-text."""
    rng = random.Random(0)
    runs = [ours.encode_chat(m) for m in CHATS]
    runs += [[rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(200)]
    for ids in runs:
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_special_ids_and_vocabulary_match_transformers(ours, reference):
    assert ours.eos_token_id == reference.eos_token_id == 2
    assert ours.vocab_size == len(reference)


def test_incremental_decoder_emits_the_whole_text(ours):
    """Token by token, multi-byte characters split over several tokens come out whole."""
    ids = ours.encode_prompt(EMOJI + UNICODE)
    dec = IncrementalDecoder(ours)
    pieces = [dec.push([i]) for i in ids]
    assert "".join(pieces) == ours.decode(ids) and not any("\ufffd" in p for p in pieces)


def test_hf_folder_matches_transformers(reference, tmp_path):
    """An HF folder (here: transformers' own save of the GGUF tokenizer) exports to the same behaviour."""
    folder = tmp_path / "hf"
    reference.save_pretrained(folder)
    from_folder = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    export(folder, tmp_path / "export")
    tok = Tokenizer(tmp_path / "export")
    for messages in CHATS[:4]:
        assert tok.encode_chat(messages) == _reference_chat(from_folder, messages)
    assert tok.encode_prompt(CODE) == from_folder.encode(CODE, add_special_tokens=False)


def test_unknown_role_and_template_errors_are_invalid_requests(ours):
    with pytest.raises(InvalidRequest, match="unknown role"):
        ours.encode_chat([("tool", "x")])
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}", {})
    with pytest.raises(InvalidRequest, match="user first"):
        strict.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(InvalidRequest, match="empty"):
        strict.render([])


def test_template_environment_matches_transformers():
    """A template using what transformers' environment adds: namespace, loop controls, tojson without HTML
    escaping, the generation tag, dict(), trim_blocks/lstrip_blocks, special tokens as variables."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = textwrap.dedent("""\
        {{ bos_token }}
        {% set ns = namespace(n=0) %}
        {% for m in messages %}
            {% if m['role'] == 'system' %}{% continue %}{% endif %}
            {% set ns.n = ns.n + 1 %}
            <{{ m['role'] }}>{{ m['content'] | tojson }}{{ dict(a=1) | tojson }}
            {% if m['role'] == 'assistant' %}
                {% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}
            {% endif %}
        {% endfor %}
        {{ ns.n }}{% if add_generation_prompt %}<assistant>{% endif %}""")
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "<b>&'\"é👋"},
        {"role": "assistant", "content": "ok"},
    ]
    expected, _ = render_jinja_template([messages], chat_template=source, add_generation_prompt=True, **special)
    assert ChatTemplate(source, special).render(messages) == expected[0]


def test_cache_key_follows_the_model_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    first = cache_dir(model)
    assert first == cache_dir(model) and first.parent == tmp_path / "cache" / "specdec" / "tokenizers"
    model.write_bytes(b"three")  # size (and mtime) change
    assert cache_dir(model) != first


def test_gateway_process_imports_no_torch(gateway_process):
    """A fresh process imports the gateway's modules and builds its Tokenizer from the GGUF file with an empty cache:
    the export runs in a child process, and neither torch nor transformers is imported here."""
    assert gateway_process["heavy"] == []
    assert gateway_process["ids"][-4:] == [1, 520, 9531, 198]
    assert gateway_process["text"].endswith("user\nHello\nassistant\n")
    assert len(list(gateway_process["cache"].glob(f"specdec/tokenizers/*/{META_FILE}"))) == 1  # the export landed
