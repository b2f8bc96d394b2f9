"""Structured outputs (guided decoding) with xgrammar, as vLLM does them.

A request constrains its output with at most one of OpenAI's `response_format`
({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}), vLLM's
`structured_outputs` ({"json" | "regex" | "choice" | "grammar": ...} or {"json_object": true}) or
its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (xgrammar's EBNF);
guided_fields.parse_guided turns the request body's fields into a `GuidedSpec` (kind + spec text),
which travels in SamplingParams (it pickles: `--frontend process` sends it over the link).

`GrammarCache` compiles specs against one model's vocabulary (an `xgrammar.TokenizerInfo`
built from the project's own tokenizer, lazily, on the first guided request) and keeps the
compiled grammars in an LRU keyed by (kind, spec text): the HTTP layer compiles to validate (a
bad schema, regex or grammar is a 400 naming its field), and the engine finds it compiled when
it makes the request's `xgrammar.GrammarMatcher`. Each step the engine fills the matchers' next-
token bitmasks (`fill_bitmask`); the sampler sets the logits of the tokens a row's bitmask leaves
out to -inf; the engine feeds each sampled token back to its matcher. Under speculative decoding the
runner masks each position it verifies the same way (`draft_bitmask`: the matcher advanced through
the drafts and rolled back), so every committed token, accepted draft or not, is one the grammar allows.

xgrammar (which imports torch) is imported only here and only when a guided request comes: never
on the start-up path. Without it, guided requests are refused with what to install.

JSON follows the schema in xgrammar's strict mode (no properties or items the schema does not
list), with any whitespace between elements but at most MAX_JSON_WHITESPACE characters of it in
a row: a model that keeps choosing whitespace (a real risk: vLLM's disable_any_whitespace exists
for it) runs out of it instead of out of max_tokens; `structured_outputs.disable_any_whitespace:
true` allows none but xgrammar's separators (", " and ": ", as json.dumps writes them; as vLLM).
`json_object` is the schema {"type": "object"} (any JSON object, as vLLM; xgrammar's builtin
JSON grammar would allow an array too).
`guided_choice` becomes the EBNF grammar `root ::= "a" | "b" | ...` (exact strings).
"""
from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from resident.worker.guided_fields import (GUIDED_FIELDS, GUIDED_KINDS, MAX_JSON_WHITESPACE, GuidedDecodingError,
                                           GuidedSpec, parse_guided)

logger = logging.getLogger(__name__)

#: Compiled grammars kept per GrammarCache (one model).
MAX_CACHED_GRAMMARS = 256
#: A message from xgrammar is cut to this many characters.
MAX_ERROR_CHARS = 500
XGRAMMAR_REQUIREMENT = "xgrammar>=0.2.9"   # as pyproject.toml
_JSON_OBJECT_SCHEMA = '{"type": "object"}'


# --- xgrammar -----------------------------------------------------------------------------
def import_xgrammar(param: str | None = None) -> Any:
    """The xgrammar module, or a GuidedDecodingError saying what to install."""
    try:
        import xgrammar
    except ImportError as e:
        raise GuidedDecodingError(
            f"structured outputs (response_format json_object/json_schema, guided_json/regex/choice/grammar) need "
            f"the xgrammar package, which this server cannot import ({e}); install it beside resident "
            f"(pip install '{XGRAMMAR_REQUIREMENT}') and restart the server", param=param) from None
    return xgrammar


_XGRAMMAR_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|cpp|h|py):\d+:\s*)?")


def short_error(e: BaseException) -> str:
    """xgrammar's message without its log prefix and C++ file (`[04:38:44] /project/cpp/regex_converter.cc:94:
    Regex parsing error ...` -> `Regex parsing error ...`), on one line, cut to MAX_ERROR_CHARS."""
    lines = [_XGRAMMAR_PREFIX.sub("", line).strip() for line in str(e).splitlines()]
    text = " ".join(line for line in lines if line) or type(e).__name__
    text = text.replace("Check failed: (error.empty()) is false: ", "")
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def tokenizer_info(tokenizer_json: str, vocab: dict[str, int], vocab_size: int,
                   stop_token_ids: Iterable[int], special_token_ids: Iterable[int] = ()) -> Any:
    """`xgrammar.TokenizerInfo` for a `tokenizers` tokenizer: its serialized form (`to_str()`, for
    the vocabulary type and prefix space xgrammar detects from it) and its vocabulary with the
    added tokens. `vocab_size` is the model's logits width (config.json's, often larger than the
    tokenizer's); ids the tokenizer lacks are "" (never allowed), ids past the logits are dropped.
    `stop_token_ids`: the model's EOS ids, which end a complete grammar. `special_token_ids` are ""
    too: their text ("<|im_end|>") would otherwise match a grammar's characters, yet the output's
    text leaves them out (and an EOS taken as text ended a regex such as `.+` at once)."""
    xgr = import_xgrammar()
    encoded = [""] * vocab_size
    for token, i in vocab.items():
        if 0 <= i < vocab_size:
            encoded[i] = token
    for i in special_token_ids:
        if 0 <= i < vocab_size:
            encoded[i] = ""
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
    stops = sorted(i for i in stop_token_ids if 0 <= i < vocab_size)
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stops or None, add_prefix_space=meta["add_prefix_space"])


def tokenizer_info_of(backend: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    """`tokenizer_info` of a `tokenizers.Tokenizer` (the worker Tokenizer's `backend`)."""
    special = [i for i, token in backend.get_added_tokens_decoder().items() if token.special]
    return tokenizer_info(backend.to_str(), backend.get_vocab(with_added_tokens=True), vocab_size, stop_token_ids,
                          special)


def tokenizer_info_from_file(path: str, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    """`tokenizer_info` from a model folder's tokenizer.json (the engine process of `--frontend
    process`, which loads no tokenizer of its own)."""
    from tokenizers import Tokenizer

    return tokenizer_info_of(Tokenizer.from_file(str(path)), vocab_size, stop_token_ids)


def _choice_grammar(choices_json: str) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(choices_json))


_WHAT = {"json": "is not a JSON schema this server can follow", "json_object": "cannot be compiled",
         "regex": "is not a regular expression this server can follow",
         "choice": "cannot be compiled", "grammar": "is not a valid EBNF grammar (xgrammar's syntax)",
         "structural_tag": "is not a structural tag this server can follow"}


def _compile_structural_tag(compiler: Any, text: str) -> Any:
    """xgrammar's structural tag (its JSON format), or vLLM's older structures + triggers form."""
    tag = json.loads(text)
    if "structures" not in tag:
        return compiler.compile_structural_tag(text)
    xgr = import_xgrammar()
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]
    return compiler.compile_structural_tag(items, tag["triggers"])


class GrammarCache:
    """Compiled grammars for one model's vocabulary, least recently used dropped past `max_entries`.

    `make_tokenizer_info()` builds the `xgrammar.TokenizerInfo`, once, on the first compile (0.15
    s for a 49k vocabulary). Thread-safe: the HTTP layer and the engine thread both compile; a spec
    compiled by both at once is compiled twice, harmlessly."""

    def __init__(self, make_tokenizer_info: Callable[[], Any], max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._make_info = make_tokenizer_info
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._vocab_size = 0
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.num_compiled = 0   # compilations done (cache misses that compiled)

    def _get_compiler(self, param: str | None) -> Any:
        xgr = import_xgrammar(param)
        with self._lock:
            if self._compiler is None:
                info = self._make_info()
                # xgrammar's own cache would grow without bound (and key the same specs): ours is the LRU.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
                self._vocab_size = info.vocab_size
            return self._compiler

    @property
    def vocab_size(self) -> int:
        """The bitmask's vocabulary (the model's logits width); 0 before the first compile."""
        return self._vocab_size

    def compile(self, spec: GuidedSpec) -> Any:
        """The `xgrammar.CompiledGrammar` of `spec`; GuidedDecodingError (naming spec.param) for a
        schema, regex or grammar xgrammar refuses, or when xgrammar is missing."""
        with self._lock:
            compiled = self._compiled.get(spec.key)
            if compiled is not None:
                self._compiled.move_to_end(spec.key)
                return compiled
        compiler = self._get_compiler(spec.param or None)
        try:
            if spec.kind in ("json", "json_object"):
                compiled = compiler.compile_json_schema(
                    spec.spec or _JSON_OBJECT_SCHEMA, any_whitespace=spec.any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace else None)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.spec)
            elif spec.kind == "structural_tag":
                compiled = _compile_structural_tag(compiler, spec.spec)
            else:
                compiled = compiler.compile_grammar(spec.spec if spec.kind == "grammar" else _choice_grammar(spec.spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and others for bad input
            name = spec.param or spec.kind
            raise GuidedDecodingError(f"'{name}' {_WHAT[spec.kind]}: {short_error(e)}", param=spec.param or None) \
                from None
        with self._lock:
            self.num_compiled += 1
            self._compiled[spec.key] = compiled
            self._compiled.move_to_end(spec.key)
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: GuidedSpec) -> Any:
        """A fresh `xgrammar.GrammarMatcher` for one request."""
        xgr = import_xgrammar(spec.param or None)
        return xgr.GrammarMatcher(self.compile(spec))

    def fill_bitmask(self, matchers: list[Any]) -> Any:
        """int32 CPU tensor [len(matchers), ceil(vocab / 32)]: row i the tokens matchers[i] allows
        next (bit t set = token t allowed)."""
        xgr = import_xgrammar()
        bitmask = xgr.allocate_token_bitmask(len(matchers), self._vocab_size)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        return bitmask


def draft_bitmask(matcher: Any, vocab_size: int, drafts: Sequence[int],
                  reasoning_end: int | None = None) -> tuple[int, Any]:
    """Speculative decoding of a guided request: how many of `drafts` its grammar accepts in a row,
    and the int32 CPU bitmask [that many + 1, ceil(vocab_size / 32)] of the tokens allowed at each
    position the target verifies (row j: after the first j drafts). Drafts past the first one the
    grammar refuses are never committed (the target's masked distribution gives that one no
    chance), so the caller drops them before verifying. A draft that ends the grammar (a stop token
    it accepts) is the last kept, and the row after it allows every token: what is drawn there is
    dropped, the request stopping at the grammar's end. `matcher` is left as it was (rolled back).
    `reasoning_end`: the request still reasons (guided_requests.py) and its grammar starts after
    this token: positions up to it are free, the one after it masked, drafts past it dropped."""
    xgr = import_xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(drafts) + 1, vocab_size)   # every bit set: every token allowed
    if reasoning_end is not None:
        if reasoning_end not in drafts:
            return len(drafts), bitmask
        end = list(drafts).index(reasoning_end) + 1
        matcher.fill_next_token_bitmask(bitmask, end)
        return end, bitmask[:end + 1]
    matcher.fill_next_token_bitmask(bitmask, 0)
    num_valid = 0
    for token in drafts:
        # The row's bit first: a token it leaves out is refused without asking the matcher (which
        # logs a warning for each special token it is offered).
        allowed = 0 <= token < vocab_size and (int(bitmask[num_valid, token // 32]) >> (token % 32)) & 1
        if not allowed or not matcher.accept_token(token):
            break
        num_valid += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, num_valid)
    if num_valid:
        matcher.rollback(num_valid)
    return num_valid, bitmask[:num_valid + 1]


__all__ = ["GUIDED_FIELDS", "GUIDED_KINDS", "GrammarCache", "draft_bitmask", "GuidedDecodingError", "GuidedSpec",
           "import_xgrammar", "parse_guided", "short_error", "tokenizer_info", "tokenizer_info_from_file",
           "tokenizer_info_of"]
