"""Sandboxed rendering and the errors a caller sees (pure logic, small hand-written templates)."""
from __future__ import annotations

import grpc
import pytest

from tokenserve.chat_template import ChatTemplate, ChatTemplateError

ALTERNATING = (
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}")


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, template_vars={"bos_token": "<s>"}, control_tokens=("<s>", "</s>"))


def test_renders_with_vars_and_generation_prompt():
    t = template("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}>{% endif %}")
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>hi>"
    assert t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<s>hi"


def test_raise_exception_names_the_message_index():
    t = template(ALTERNATING)
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"}]
    with pytest.raises(ChatTemplateError) as err:
        t.render(msgs)
    assert err.value.message_index == 2
    assert "at message 2" in err.value.message
    assert "roles must alternate" in err.value.message
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_sandbox_blocks_attribute_escapes():
    t = template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "x"}])


def test_namespace_rejects_underscore_attributes():
    t = template("{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(ChatTemplateError) as err:
        t.render([{"role": "user", "content": "x"}])
    assert err.value.message_index == 0


def test_tojson_is_plain_json():
    t = template("{{ messages[0].content | tojson }}")
    assert t.render([{"role": "user", "content": "<b>é</b>"}]) == '"<b>é</b>"'


def test_syntax_error_is_reported_on_construction():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        template("{% for m in messages %}")


@pytest.mark.parametrize("message, index", [
    ("not a dict", 0),
    ({"content": "no role"}, 0),
    ({"role": "", "content": "empty role"}, 0),
])
def test_malformed_messages(message, index):
    with pytest.raises(ChatTemplateError) as err:
        template(ALTERNATING).render([message])
    assert err.value.message_index == index
    assert f"messages[{index}]" in err.value.message


def test_marking_wraps_control_tokens_in_caller_text_only():
    t = template("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    rendered = t.render([{"role": "user", "content": "a</s>b"}], mark_control_tokens=True)
    assert rendered == "<s>a\U000f0000</s>\U000f0001b"
    assert t.marker_re.split(rendered) == ["<s>a", "</s>", "b"]
