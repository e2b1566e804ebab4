"""A model's chat template: sandboxed rendering, and marking of control tokens in user text.

Chat templates ship inside model artifacts, so they are untrusted code: they run in jinja2's
ImmutableSandboxedEnvironment with the same globals transformers gives them (`raise_exception`,
`strftime_now`, a JSON `tojson`, `loopcontrols`), so a template renders here exactly as it
renders there.

Control-token safety follows transformers' `apply_chat_template(sanitize_control_tokens=True)`:
every control-token string inside a caller's strings (content, role, ...) is wrapped in two
private-use markers before rendering. The encoder (`ModelTokenizer.encode_chat`) then splits the
rendered text on the markers: the template's own control tokens stay control tokens, a marked
one is encoded as plain text. A user who types "<|im_end|>" cannot close their own turn.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenserve.runtime.errors import InvalidArgument

# Private-use code points (plane 15) that wrap a control token found in caller text; the same
# ones transformers uses, so renderings compare equal.
MARK_START = "\U000f0000"
MARK_END = "\U000f0001"


class ChatTemplateError(InvalidArgument):
    """The conversation cannot be rendered; `message_index` names the message when known."""

    def __init__(self, message: str, *, message_index: int | None = None):
        super().__init__(message)
        self.message_index = message_index


class _TemplateDict:
    # `dict(...)` inside templates, without exposing the real type's attributes.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Rejects dunder/underscore attributes so a template cannot reach interpreter internals.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})")


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """Raised by the template's own `raise_exception(...)` call."""


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    # only needs the body.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _compile_checked(source: str) -> jinja2.Template:
    try:
        return _compile(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the model's chat template does not parse: {exc}") from exc


def template_literal_text(source: str) -> str:
    """Every literal string of the template joined by NULs (no match can span two literals)."""
    env = _compile_checked(source).environment
    ast = env.parse(source)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(literals)


def _plain(value: Any) -> Any:
    # The template sees only plain JSON-like data, never caller objects with methods.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _mark(value: Any, control_re: re.Pattern) -> Any:
    # Strips stray markers first so a caller cannot forge a "marked" token.
    if isinstance(value, str):
        value = value.replace(MARK_START, "").replace(MARK_END, "")
        return control_re.sub(f"{MARK_START}\\g<0>{MARK_END}", value)
    if isinstance(value, dict):
        return {k: _mark(v, control_re) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark(v, control_re) for v in value]
    return value


def alternation(tokens: Sequence[str]) -> re.Pattern:
    """A regex matching any of `tokens`, longest first (a token wins over the tokens it contains)."""
    longest_first = sorted(set(tokens), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first)) or "(?!)")


class ChatTemplate:
    """One model's chat template with the special-token strings it may reference."""

    def __init__(self, source: str, *, template_vars: Mapping[str, str],
                 control_tokens: Sequence[str]):
        """`template_vars`: bos_token, eos_token... as the template reads them.
        `control_tokens`: the strings that, typed by a caller, must be encoded as plain text."""
        self._template = _compile_checked(source)
        self.source = source
        self._vars = dict(template_vars)
        self.control_tokens = tuple(control_tokens)
        self._control_re = alternation(self.control_tokens)
        self.marker_re = re.compile(
            f"{MARK_START}({self._control_re.pattern}){MARK_END}|[{MARK_START}{MARK_END}]")

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               mark_control_tokens: bool = False) -> str:
        """The conversation as the model's prompt text.

        With `mark_control_tokens`, control-token strings in caller text come back wrapped in
        MARK_START/MARK_END (for `ModelTokenizer.encode_chat`); otherwise the text is exactly
        what transformers' `apply_chat_template(tokenize=False)` returns.
        """
        chat = _normalize(messages)
        if mark_control_tokens:
            chat = _mark(chat, self._control_re)
        try:
            return self._render(chat, add_generation_prompt)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError,
                AttributeError, IndexError, ZeroDivisionError) as exc:
            index = self._first_failing_message(chat, add_generation_prompt)
            where = f" at message {index}" if index is not None else ""
            reason = str(exc) if isinstance(exc, _TemplateRaised) else f"{type(exc).__name__}: {exc}"
            raise ChatTemplateError(
                f"the model's chat template rejected the conversation{where}: {reason}",
                message_index=index) from exc

    def _render(self, chat: list[dict], add_generation_prompt: bool) -> str:
        return self._template.render(messages=chat, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt, **self._vars)

    def _first_failing_message(self, chat: list[dict], add_generation_prompt: bool) -> int | None:
        # Error path only: the shortest failing prefix names the message that broke the template.
        for end in range(1, len(chat) + 1):
            try:
                self._render(chat[:end], add_generation_prompt)
            except Exception:  # noqa: BLE001 - any failure of the prefix is the answer
                return end - 1
        return None


def _normalize(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Plain dicts without None values (templates handle a missing key, not a None)."""
    chat = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"messages[{index}] must be a mapping with 'role' and 'content', got "
                f"{type(message).__name__}", message_index=index)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}].role must be a non-empty string",
                                    message_index=index)
        chat.append({k: v for k, v in _plain(message).items() if v is not None})
    return chat
