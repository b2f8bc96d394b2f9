"""Chat templates rendered the way HF transformers renders them, in a jinja2 sandbox.

Templates come from model folders or (when the server allows it) from requests, so they are
untrusted code: they run in an ImmutableSandboxedEnvironment, see only plain JSON-like data,
and a reach for Python internals fails loudly instead of rendering an empty string. The
environment mirrors transformers' `_compile_jinja_template`: trim_blocks, lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` filter that does not
HTML-escape, and `dict`/`namespace` globals that cannot be used to break out.

Every failure (syntax, sandbox violation, `raise_exception`, a template crashing on its input)
becomes a `ChatTemplateError` carrying the template's message; the server answers it with
HTTP 400.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template could not be compiled or rendered; the message says why.

    `kind` is one of "syntax", "security", "raised" (the template called raise_exception),
    "render" (the template failed on this input), "missing" (the model has no template) or
    "tool_calls" (the messages hold tool calls or tool results the template does not render).
    `param` names the message at fault, when one is.
    """

    def __init__(self, message: str, kind: str = "render", param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.param = param


class NoChatTemplateError(ChatTemplateError):
    """A chat request for a model without a chat template."""

    def __init__(self, message: str = "model has no chat template; use /v1/completions or start "
                                      "with --chat-template FILE") -> None:
        super().__init__(message, kind="missing")


class _SandboxUndefined(jinja2.Undefined):
    """Plain jinja renders a blocked attribute (`''.__class__`) as an empty string; a template
    that tries that is hostile or broken, so using the result fails with SecurityError."""

    __slots__ = ()

    def _check(self) -> None:
        if self._undefined_exception is SecurityError:
            self._fail_with_undefined_error()

    def __str__(self) -> str:
        self._check()
        return super().__str__()

    def __bool__(self) -> bool:
        self._check()
        return super().__bool__()

    def __iter__(self):
        self._check()
        return super().__iter__()

    def __len__(self) -> int:
        self._check()
        return super().__len__()


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed names (a route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a "
                                f"namespace, got {name!r}")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '); templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=_SandboxUndefined,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def plain_data(value: Any) -> Any:
    """Rebuild `value` from plain JSON types (as transformers does): objects with methods the
    sandbox does not know to be dangerous never reach the template."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _reads_tool_calls(template: Any) -> bool:
    """Whether a template's source reads `tool_calls` at all (`message.tool_calls`,
    `message['tool_calls']`, `'tool_calls' in message`, `message.get('tool_calls')`): one
    that never does cannot render an assistant turn that only calls tools."""
    return any(node.attr == "tool_calls" for node in template.find_all(jinja2.nodes.Getattr)) or any(
        node.value == "tool_calls" for node in template.find_all(jinja2.nodes.Const))


def _tool_message(messages: list[dict], content_only: bool = False) -> tuple[int, dict] | None:
    """The first message of a tool-use conversation: an assistant turn with tool_calls (with
    `content_only`, only one without content) or a tool result; None when there is none."""
    for i, m in enumerate(messages):
        if m.get("tool_calls") and not (content_only and m.get("content")):
            return i, m
        if not content_only and m.get("role") == "tool":
            return i, m
    return None


def _no_tool_support(found: tuple[int, dict], why: str) -> ChatTemplateError:
    i, m = found
    what = "tool_calls" if m.get("tool_calls") else "a tool result"
    return ChatTemplateError(
        f"messages[{i}] (role {m.get('role')}) holds {what}, but the model's chat template does not support "
        f"tool calls ({why}); start the server with a --chat-template that renders tool calls, or send the "
        "tool call and its result as plain 'content'", kind="tool_calls", param=f"messages[{i}]")


def normalize_messages(messages: Any) -> list[dict]:
    """Messages as plain dicts without None values: OpenAI clients send `content: null` or
    `tool_calls: null`, which many templates would render as "None" (transformers drops them)."""
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages must be a list of objects, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(plain_data(list(messages))):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content', "
                                    f"got {type(message).__name__}")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def message_text(message: Any) -> str | None:
    """A message's text: its string content, or its content parts' last text part (as transformers
    reads the final message for continue_final_message); None when it has no text."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, (list, tuple)):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = texts[-1] if texts else None
    return content if isinstance(content, str) else None


def final_message_end(text: str, message: Any) -> int:
    """Where the final message's content ends in the rendered `text` (its last occurrence; as
    transformers, stripped when the template strips contents, as Llama 3's does), for
    continue_final_message. A ChatTemplateError naming the field when it has no text or the
    template does not render it as sent."""
    content = message_text(message)
    if not content or not content.strip():
        raise ChatTemplateError("'continue_final_message' needs a final message with text to continue; this one "
                                "has none", param="continue_final_message")
    for needle in (content, content.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return at + len(needle)
    raise ChatTemplateError("'continue_final_message': the chat template does not write the final message's text "
                            "as sent, so the prompt cannot end inside it", param="continue_final_message")


class ChatTemplate:
    """One compiled chat template. Compiling checks the syntax, so a broken template fails when
    it is loaded, not at the first request."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError("the chat template is empty", kind="syntax")
        self.source = source
        try:
            env = _environment()
            ast = env.parse(source)   # parsed once: read for tool_calls, then compiled
            self.reads_tool_calls = _reads_tool_calls(ast)
            self._template = env.from_string(ast)
        except TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}",
                                    kind="syntax") from e
        except TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}", kind="syntax") from e

    def render(self, messages: Any, *, add_generation_prompt: bool = True, tools: list | None = None,
               documents: list | None = None, special_tokens: Mapping[str, Any] | None = None,
               **kwargs: Any) -> str:
        """Render a conversation. Variables: messages, add_generation_prompt, tools, documents,
        the special tokens (bos_token, eos_token, ...) and any extra kwargs (which win over
        the special tokens, as in transformers). A template that never reads `tool_calls`
        refuses an assistant turn that only calls tools (it would vanish from the prompt or
        crash the template), and its failure on a tool-use conversation says so."""
        variables = {**(special_tokens or {}), **kwargs}
        variables = plain_data(variables)
        messages = normalize_messages(messages)
        if not self.reads_tool_calls and (found := _tool_message(messages, content_only=True)):
            raise _no_tool_support(found, "it never reads a message's tool_calls")
        variables.update(messages=messages, add_generation_prompt=bool(add_generation_prompt),
                         tools=plain_data(tools), documents=plain_data(documents))
        try:
            return self._template.render(**variables)
        except Exception as e:  # noqa: BLE001  untrusted code on user input: any crash is a bad request
            error = _render_failure(e)
            if error.kind != "security" and not self.reads_tool_calls and (found := _tool_message(messages)):
                error = _no_tool_support(found, f"it failed on them: {error}")
            raise error from e


def read_template_file(path: str) -> str:
    """The source of a `--chat-template FILE`, read and compiled: a file that is not UTF-8 or
    does not compile is refused at once by the CLI (the worker would read it only after the
    weights), with a ValueError naming the flag, the file and what is wrong."""
    try:
        source = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"cannot read --chat-template {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                         "save the template as UTF-8") from None
    try:
        ChatTemplate(source)
    except ChatTemplateError as e:
        raise ValueError(f"--chat-template {path}: {e}; fix the template or leave the option out to use "
                         "the model's own") from None
    return source


def _render_failure(e: Exception) -> ChatTemplateError:
    if isinstance(e, SecurityError):
        return ChatTemplateError(f"chat template tried an unsafe operation: {e}", kind="security")
    if type(e) is TemplateError:  # raise_exception(...) from the template itself
        return ChatTemplateError(str(e), kind="raised")
    if isinstance(e, TemplateError):
        return ChatTemplateError(f"chat template failed: {e}", kind="render")
    return ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}", kind="render")
