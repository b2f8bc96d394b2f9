"""Chat templates render exactly as HF transformers renders them, support what real templates
use (loop controls, raise_exception, strftime_now, tojson, namespace), and keep untrusted
templates inside the sandbox."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from fixtures_tokenizer import write_tiny_tokenizer
from resident.worker.chat_template import ChatTemplate, ChatTemplateError
from resident.worker.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? Answer in 日本語 😀"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "  spaced \n lines  "}],
]

# Exercises what Hub templates use: namespace, loop controls, tojson with indent, dict(),
# raise_exception, bos_token, tools and extra kwargs.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='', turns=0) %}
{%- for m in messages %}
  {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif %}
  {%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
  {%- set ns.turns = ns.turns + 1 %}
{% endfor %}
{% if ns.system %}<<SYS>>{{ ns.system | trim }}<</SYS>>
{% endif %}
{% if tools %}Tools:
{{ tools | tojson(indent=2) }}
{% endif %}
{% for m in messages if m.role != 'system' %}
{% if loop.index > max_turns | default(100) %}{% break %}{% endif %}
[{{ loop.index }}/{{ ns.turns }}] {{ m.role }}: {{ m.content }}{{ eos_token if m.role == 'assistant' }}
{% endfor %}
{% set meta = dict(n=messages | length) %}
{{ meta | tojson }}
{% if add_generation_prompt %}assistant:{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für <Ort> & Zeit",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def smollm(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_folder(default_model_dir)


@pytest.fixture(scope="module")
def hf_smollm(default_model_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm_template_matches_hf(smollm, hf_smollm, add_generation_prompt):
    for messages in CONVERSATIONS:
        ours = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf_smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               tokenize=False)
        assert ours == theirs
        # Encoded without adding special tokens (the template placed them), ids match too.
        assert smollm.encode(ours, add_special_tokens=False) == hf_smollm.encode(theirs, add_special_tokens=False)


def test_smollm_prompt_shape(smollm):
    prompt = smollm.apply_chat_template(CONVERSATIONS[0])
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                      "<|im_start|>assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_template_matches_hf(smollm, hf_smollm, add_generation_prompt):
    for messages in CONVERSATIONS:
        for kwargs in ({}, {"tools": TOOLS}, {"max_turns": 1}):
            ours = smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                              chat_template=RICH_TEMPLATE, **kwargs)
            theirs = hf_smollm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                   chat_template=RICH_TEMPLATE, tokenize=False, **kwargs)
            assert ours == theirs, kwargs
    rendered = smollm.apply_chat_template(CONVERSATIONS[2], chat_template=RICH_TEMPLATE, tools=TOOLS, max_turns=2)
    assert '"description": "Wetter für <Ort> & Zeit"' in rendered  # tojson: no HTML or ASCII escaping
    assert "[2/3] assistant: 4<|im_end|>" in rendered and "[3/3]" not in rendered  # {% break %}


def test_tiny_chatml_template_matches_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_tokenizer(tmp_path / "tiny")
    ours = Tokenizer.from_folder(folder)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False)


def test_raise_exception_surfaces_the_template_message(smollm):
    with pytest.raises(ChatTemplateError) as e:
        smollm.apply_chat_template([{"role": "wizard", "content": "x"}], chat_template=RICH_TEMPLATE)
    assert str(e.value) == "unknown role wizard"
    assert e.value.kind == "raised"


def test_loop_controls_and_strftime_now():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.skip %}{% continue %}{% endif %}"
        "{% if m.stop %}{% break %}{% endif %}{{ m.content }};{% endfor %}"
        "{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.now().strftime("%Y-%m-%d")
    out = template.render([{"content": "a"}, {"content": "b", "skip": True}, {"content": "c"},
                           {"content": "d", "stop": True}, {"content": "e"}])
    after = datetime.now().strftime("%Y-%m-%d")
    assert out in (f"a;c;{before}", f"a;c;{after}")


def test_trim_and_lstrip_blocks_like_hf():
    template = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert template.render([{"content": "x"}, {"content": "y"}]) == "x\ny\n"


def test_none_fields_are_dropped_not_rendered():
    # OpenAI clients send "content": null with tool calls; templates test for presence.
    template = ChatTemplate("{% for m in messages %}{% if m.content is defined %}{{ m.content }}"
                            "{% else %}<no content>{% endif %}{% endfor %}")
    assert template.render([{"role": "assistant", "content": None}]) == "<no content>"


@pytest.mark.parametrize("source", [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% if ''.__class__ %}x{% endif %}",
    "{{ messages.append({'role': 'user'}) }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
    "{{ namespace(__class__=1) }}",
    "{{ (1).__add__(2) }}",
])
def test_sandbox_blocks_python_internals(source):
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])
    assert e.value.kind == "security"
    assert "unsafe" in str(e.value)
    from jinja2.exceptions import SecurityError

    assert isinstance(e.value.__cause__, SecurityError)


def test_objects_reach_templates_as_plain_data():
    class Sneaky(str):
        def danger(self):  # a method the sandbox does not know about
            raise AssertionError("called")

    out = ChatTemplate("{{ messages[0].content }}|{{ messages[0].content.danger is defined }}|{{ obj }}").render(
        [{"role": "user", "content": Sneaky("hi")}], obj=object())
    assert out == "hi|False|<object>"


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate("line one\n{% for m in messages %}{{ m.content }")
    assert e.value.kind == "syntax"
    assert "line 2" in str(e.value)


def test_template_crashing_on_input_is_a_bad_request():
    # A template that concatenates content assumes strings; list content makes it fail.
    template = ChatTemplate("{{ 'x' + messages[0].content }}")
    with pytest.raises(ChatTemplateError) as e:
        template.render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert e.value.kind == "render"


def test_messages_must_be_objects(smollm):
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]"):
        smollm.apply_chat_template([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        smollm.apply_chat_template([])


def test_huge_ranges_are_refused():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for i in range(10**9) %}x{% endfor %}").render([])
