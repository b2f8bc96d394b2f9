"""The worker's tokenizer: `tokenizer.json` through the `tokenizers` library, plus what HF keeps
beside it — special tokens and BOS/EOS policy (tokenizer_config.json), chat templates
(chat_template.jinja, chat_templates/*.jinja, or tokenizer_config.json's `chat_template`,
a string or a list of named templates) and the EOS ids generation stops at
(generation_config.json, an int or a list; config.json when there is no generation config).

`add_bos_token`/`add_eos_token`, when tokenizer_config.json states them, rewrite the
post-processor as transformers' Llama-family tokenizers do (models such as the
DeepSeek-R1 Qwen distills rely on it); otherwise tokenizer.json's own post-processor decides.
`clean_up_tokenization_spaces` is ignored, as transformers 5 ignores it for BPE tokenizers
(it would also make streamed text differ from the full decode).
Chat prompts are rendered to text; encode them with `add_special_tokens=False`, as
transformers does, since the template already placed the special tokens.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as _BackendTokenizer
from tokenizers import processors

if TYPE_CHECKING:
    # Imported where a template is compiled (jinja2 is not needed before the first chat request).
    from resident.worker.chat_template import ChatTemplate

logger = logging.getLogger(__name__)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """A model folder's tokenizer files are missing or unreadable; the message names the fix."""


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """Special tokens are strings or serialized AddedToken dicts ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _as_id_list(value: Any) -> list[int]:
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _load_chat_templates(folder: Path, tokenizer_config: dict) -> dict[str, str]:
    """name -> template source; "default" is the one used when the caller names none.
    Files written by transformers (chat_template.jinja, chat_templates/) win over
    tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    configured = tokenizer_config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        for entry in configured:
            if isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str):
                templates[entry["name"]] = entry["template"]
    elif isinstance(configured, dict):
        templates.update({k: v for k, v in configured.items() if isinstance(v, str)})
    processor_file = folder / "chat_template.json"  # processors of multimodal models keep it here
    if "default" not in templates and processor_file.is_file():
        source = _read_json(processor_file).get("chat_template")
        if isinstance(source, str):
            templates["default"] = source
    named_dir = folder / "chat_templates"
    if named_dir.is_dir():
        for path in sorted(named_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    default_file = folder / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    return templates


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(self, backend: _BackendTokenizer, *, special_tokens: dict[str, str] | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 chat_templates: dict[str, str] | None = None, generation_eos_token_ids: list[int] | None = None,
                 model_max_length: int | None = None, name: str = "") -> None:
        self._backend = backend
        self.name = name
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self._id_of_special("bos_token")
        self._eos_token_id = self._id_of_special("eos_token")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # Every EOS counts: the tokenizer's and generation_config.json's (Llama 3 lists several).
        # Models often have more embedding rows than the tokenizer has tokens, so an EOS id past
        # the tokenizer's vocabulary can still be sampled: keep it, but say so.
        eos_ids = [self._eos_token_id] if self._eos_token_id is not None else []
        self.eos_token_ids: set[int] = {i for i in [*eos_ids, *(generation_eos_token_ids or [])] if i >= 0}
        beyond = sorted(i for i in self.eos_token_ids if i >= self.vocab_size)
        if beyond:
            logger.warning("%s: EOS token ids %s lie beyond the tokenizer's vocabulary (size %d); "
                           "check generation_config.json", name or "tokenizer", beyond, self.vocab_size)
        self.model_max_length = model_max_length
        self._configure_post_processor(add_bos_token, add_eos_token)
        self.all_special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self._compiled: dict[str, ChatTemplate] = {}

    def _id_of_special(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            logger.warning("%s %r from tokenizer_config.json is not in the vocabulary; ignoring it", key, token)
        return token_id

    def _configure_post_processor(self, add_bos: bool | None, add_eos: bool | None) -> None:
        # Rebuilt when tokenizer_config.json states either flag (or tokenizer.json has no
        # post-processor); otherwise tokenizer.json's own rules stand.
        if add_bos is None and add_eos is None and self._backend.post_processor is not None:
            return
        add_bos = bool(add_bos) and self.bos_token_id is not None
        eos_id = self._eos_token_id
        add_eos = bool(add_eos) and eos_id is not None
        single = f"{self.bos_token}:0 " if add_bos else ""
        single += "$A:0" + (f" {self.eos_token}:0" if add_eos else "")
        pair = single + (f" {self.bos_token}:1" if add_bos else "") + " $B:1" + (f" {self.eos_token}:1" if add_eos else "")
        special = ([(self.bos_token, self.bos_token_id)] if add_bos else []) + ([(self.eos_token, eos_id)] if add_eos else [])
        self._backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    @classmethod
    def from_folder(cls, path: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """Load from a model folder. `chat_template` (template source) replaces the folder's
        default template, e.g. from `resident serve --chat-template FILE`."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{folder} has no tokenizer.json; the engine needs a fast (tokenizers-library) tokenizer "
                "file. Save one with transformers (`AutoTokenizer.from_pretrained(...).save_pretrained(folder)`) "
                "or serve a folder that includes it")
        try:
            backend = _BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # noqa: BLE001  the library raises bare Exceptions on bad files
            raise TokenizerError(f"cannot load {tokenizer_file}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        special = {k: tok for k in _SPECIAL_TOKEN_KEYS if (tok := _token_content(config.get(k))) is not None}
        generation = _read_json(folder / "generation_config.json")
        if "eos_token_id" in generation:
            eos_ids = _as_id_list(generation.get("eos_token_id"))
        else:
            eos_ids = _as_id_list(_read_json(folder / "config.json").get("eos_token_id"))
        templates = _load_chat_templates(folder, config)
        if chat_template is not None:
            templates["default"] = chat_template
        max_len = config.get("model_max_length")
        tokenizer = cls(
            backend, special_tokens=special,
            add_bos_token=config.get("add_bos_token") if isinstance(config.get("add_bos_token"), bool) else None,
            add_eos_token=config.get("add_eos_token") if isinstance(config.get("add_eos_token"), bool) else None,
            chat_templates=templates, generation_eos_token_ids=eos_ids,
            model_max_length=max_len if isinstance(max_len, int) and max_len < 10**12 else None,
            name=str(folder))
        if chat_template is not None:
            tokenizer.get_chat_template()  # a broken --chat-template FILE fails at start-up
        logger.info("tokenizer %s: vocab %d, bos %s, eos %s, chat templates %s", folder, tokenizer.vocab_size,
                    tokenizer.bos_token_id, sorted(tokenizer.eos_token_ids), sorted(templates) or "none")
        return tokenizer

    @property
    def backend(self) -> _BackendTokenizer:
        """The `tokenizers.Tokenizer` underneath (structured outputs read its vocabulary and type)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_last(self, text: str, num_tokens: int, add_special_tokens: bool = True) -> tuple[list[int], int]:
        """The last `num_tokens` tokens of `encode(text)` as transformers' left truncation gives them
        (vLLM's truncate_prompt_tokens): the special tokens the post-processor adds (a BOS) kept, the
        text's own tokens cut from the left to make room; and how many tokens the text itself has."""
        encoding = self._backend.encode(text, add_special_tokens=False)
        num_text = len(encoding.ids)
        num_special = self._backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if num_text + num_special <= num_tokens or num_tokens <= num_special:
            return self.encode(text, add_special_tokens)[-num_tokens:], num_text
        encoding.truncate(num_tokens - num_special, direction="left")
        return self._backend.post_process(encoding, add_special_tokens=add_special_tokens).ids, num_text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        """Raw token strings (byte-level BPE: the mapped bytes), for the incremental detokenizer."""
        return [self._backend.id_to_token(i) or "" for i in ids
                if not (skip_special_tokens and i in self.all_special_ids)]

    def decode_tokens(self, tokens: list[str]) -> str:
        """Decode raw token strings (as from convert_ids_to_tokens) with the tokenizer's decoder."""
        decoder = self._backend.decoder
        return decoder.decode(tokens) if decoder is not None else "".join(tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> ChatTemplate:
        """The compiled template to use: `chat_template` is a template's name or its source;
        None picks "tool_use" when tools are given and the model has one, else "default"."""
        from resident.worker.chat_template import ChatTemplate, ChatTemplateError, NoChatTemplateError

        if chat_template is not None and chat_template not in self.chat_templates:
            return ChatTemplate(chat_template)  # request-supplied source: compiled per call
        if chat_template is None:
            if not self.chat_templates:
                raise NoChatTemplateError()
            if tools and "tool_use" in self.chat_templates:
                chat_template = "tool_use"
            elif "default" in self.chat_templates:
                chat_template = "default"
            else:
                raise ChatTemplateError(
                    f"model has several chat templates {sorted(self.chat_templates)} and none is the default; "
                    "name one with the chat_template argument", kind="missing")
        compiled = self._compiled.get(chat_template)
        if compiled is None:
            compiled = self._compiled[chat_template] = ChatTemplate(self.chat_templates[chat_template])
        return compiled

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list | None = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> str:
        """Render a conversation to the prompt text (encode it with add_special_tokens=False).
        `continue_final_message` (transformers'): the text ends right after the final message's
        content, whatever the template writes after it (its end-of-turn), so the model continues
        that message. Raises ChatTemplateError (NoChatTemplateError when the model has no template)."""
        from resident.worker.chat_template import ChatTemplateError, final_message_end

        if not isinstance(messages, (list, tuple)) or not messages:
            raise ChatTemplateError("messages must be a non-empty list")
        template = self.get_chat_template(chat_template, tools)
        text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               special_tokens=self.special_tokens, **template_kwargs)
        return text[:final_message_end(text, messages[-1])] if continue_final_message else text


def compile_default_chat_template_in_background(tokenizer: Any) -> threading.Thread | None:
    """Compile the model's default chat template (importing jinja2) in a daemon thread, so the
    first chat request finds it compiled; None when the model has no default template. A
    template that does not compile is logged here and reported by the first chat request."""
    if tokenizer is None or "default" not in getattr(tokenizer, "chat_templates", {}):
        return None

    def compile_default() -> None:
        try:
            tokenizer.get_chat_template()
        except Exception as e:  # noqa: BLE001 - the first chat request reports it with its own status
            logger.warning("the model's chat template does not compile: %s", e)

    thread = threading.Thread(target=compile_default, name="resident-chat-template", daemon=True)
    thread.start()
    return thread
