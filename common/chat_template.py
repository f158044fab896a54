"""Chat templates rendered the way transformers renders them, with jinja2 alone (no transformers, no torch).

The environment mirrors transformers.utils.chat_template_utils._cached_compile_jinja_template: a sandbox with
trim_blocks and lstrip_blocks, loop controls, a `{% generation %}` tag, its `tojson` filter and its
`raise_exception`, `strftime_now`, `dict` and `namespace` globals. The template sees `messages`, `tools`,
`documents`, `add_generation_prompt` and the tokenizer's named special tokens (`bos_token`, `eos_token`, ...).
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.errors import InvalidRequest


class ChatTemplate:
    """A compiled chat template; `render` is safe to call from several threads."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self._template = _environment().from_string(source)  # a syntax error surfaces here, at start-up
        self._special_tokens = dict(special_tokens)  # {"bos_token": "<|im_start|>", "eos_token": ...}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """messages: [{"role": ..., "content": ...}]; a template's raise_exception becomes InvalidRequest."""
        if not messages:
            raise InvalidRequest("the conversation is empty")
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except jinja2.TemplateError as e:
            raise InvalidRequest(f"the chat template rejected the conversation: {e}") from e


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body; transformers only tracks its position (for
    assistant masks), which tokenizing a prompt never asks for."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without attribute access to the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs):  # jinja's own signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes: {name!r}")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
