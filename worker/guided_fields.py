"""Structured outputs' request side: the fields that constrain an answer (OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_json/regex/choice/grammar`; structural
tags as vLLM takes them: response_format {"type": "structural_tag", ...}) read into a
`GuidedSpec`, and the `GuidedDecodingError` (a 400 naming the field) a malformed one is. Torch- and
xgrammar-free: the HTTP layer and the front-end process import it; structured_output.py compiles
the specs (its module doc has the JSON and whitespace rules)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

#: What a GuidedSpec constrains the output to.
GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
#: The request fields that constrain the output, in the order a conflict names them.
GUIDED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar")
#: vLLM's `structured_outputs` object (StructuredOutputsParams): its constraint keys -> the guided_* field
#: each spells the same way.
STRUCTURED_OUTPUT_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                          "grammar": "guided_grammar", "structural_tag": "structural_tag"}
#: Whitespace characters allowed in a row between JSON elements (see the module doc).
MAX_JSON_WHITESPACE = 32


class GuidedDecodingError(ValueError):
    """A guided-decoding field the server refuses (a 400): `param` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class GuidedSpec:
    """One request's constraint: `kind` (GUIDED_KINDS) and its text — the JSON schema (compact
    JSON), the regex, the choices (a JSON list of strings), the EBNF grammar, the structural tag
    (compact JSON: xgrammar's {"type": "structural_tag", "format": ...}, or vLLM's older
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}); "" for json_object.
    `any_whitespace`: JSON may hold whitespace between its elements (at most MAX_JSON_WHITESPACE in
    a row); False (vLLM's disable_any_whitespace) allows only the separators ", " and ": "; True
    for the other kinds.
    `param` is the request field it came from (errors name it); it is not part of the identity."""

    kind: str
    spec: str = ""
    param: str = field(default="", compare=False)
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided kind must be one of {', '.join(GUIDED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or not isinstance(self.param, str):
            raise ValueError(f"a guided spec's text and param must be strings, got {self.spec!r}, {self.param!r}")
        if not self.any_whitespace and self.kind not in ("json", "json_object"):
            raise ValueError(f"any_whitespace=False is for JSON (kind json or json_object), not {self.kind!r}")

    @property
    def key(self) -> tuple[str, str, bool]:
        return self.kind, self.spec, self.any_whitespace


# --- the request's fields -----------------------------------------------------------------
def _decoded(value: Any, param: str, what: str) -> Any:
    """`value`, or the JSON a string `value` holds (`what` names the object in the error)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as e:
        raise GuidedDecodingError(f"'{param}' must be {what} (an object, or a string holding one); "
                                  f"the string does not decode: {e}", param=param) from None


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as a JSON string of one, as compact JSON text."""
    value = _decoded(value, param, "a JSON schema")
    if not isinstance(value, dict):
        raise GuidedDecodingError(f"'{param}' must be a JSON schema (an object), got {json.dumps(value)[:100]}",
                                  param=param)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _structural_tag(value: Any, param: str) -> GuidedSpec:
    """A structural tag: xgrammar's format ({"format": {...}}) or vLLM's older {"structures":
    [{"begin", "schema", "end"}, ...], "triggers": [...]}, as an object or a JSON string of one."""
    value = _decoded(value, param, "a structural tag")
    if not isinstance(value, dict) or not ("format" in value or "structures" in value):
        shape = '{"type": "structural_tag", "format": {...}} or {"structures": [...], "triggers": [...]}'
        raise GuidedDecodingError(f"'{param}' must be a structural tag: {shape}, got {json.dumps(value)[:100]}",
                                  param=param)
    if "structures" in value:
        structures, triggers = value.get("structures"), value.get("triggers")
        if not isinstance(structures, list) or not structures or not all(
                isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), dict) for s in structures):
            item = '{"begin": <string>, "schema": {<JSON schema>}, "end": <string>}'
            raise GuidedDecodingError(f"'{param}.structures' must be a non-empty list of {item}",
                                      param=f"{param}.structures")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise GuidedDecodingError(f"'{param}.triggers' must be a non-empty list of strings (each a prefix of some "
                                      "structure's begin)", param=f"{param}.triggers")
        value = {"structures": structures, "triggers": triggers}
    else:
        value = {"type": "structural_tag", "format": value["format"]}
    return GuidedSpec("structural_tag", json.dumps(value, ensure_ascii=False, separators=(",", ":")), param)


def _response_format(fmt: Any) -> GuidedSpec | None:
    shape = ('{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema": '
             '{"name": "<name>", "schema": {<JSON schema>}}} or {"type": "structural_tag", ...}')
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", "", "response_format")
    if kind == "structural_tag":
        return _structural_tag({k: v for k, v in fmt.items() if k != "type"}, "response_format")
    if kind != "json_schema":
        got = json.dumps(fmt)[:200] if isinstance(fmt, dict) else type(fmt).__name__
        raise GuidedDecodingError(f"'response_format' must be {shape}, got {got}", param="response_format")
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise GuidedDecodingError(f"'response_format.json_schema' must be an object {{\"name\": \"<name>\", "
                                  f"\"schema\": {{<JSON schema>}}}}, got {json.dumps(js)[:100]}",
                                  param="response_format.json_schema")
    for key, types, what in (("name", str, "a string"), ("description", str, "a string"),
                             ("strict", (bool, type(None)), "true or false")):
        if key in js and not isinstance(js[key], types):
            raise GuidedDecodingError(f"'response_format.json_schema.{key}' must be {what}, got "
                                      f"{json.dumps(js[key])[:100]}", param=f"response_format.json_schema.{key}")
    if js.get("schema") is None:
        raise GuidedDecodingError("'response_format.json_schema.schema' is required: the JSON schema the output "
                                  "follows", param="response_format.json_schema.schema")
    param = "response_format.json_schema.schema"
    return GuidedSpec("json", _schema_text(js["schema"], param), param)


def _guided_field(name: str, value: Any, param: str) -> GuidedSpec:
    """The spec of a `guided_json/regex/choice/grammar` value (`name`), its errors naming `param`."""
    if name == "guided_json":
        return GuidedSpec("json", _schema_text(value, param), param)
    if name == "structural_tag":
        return _structural_tag(value, param)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GuidedDecodingError(f"'{param}' must be a non-empty list of strings, got "
                                      f"{json.dumps(value)[:100]}", param=param)
        return GuidedSpec("choice", json.dumps(value, ensure_ascii=False), param)
    if not isinstance(value, str) or not value:
        what = "a regular expression" if name == "guided_regex" else "an EBNF grammar (xgrammar's)"
        raise GuidedDecodingError(f"'{param}' must be a non-empty string: {what}, got {json.dumps(value)[:100]}",
                                  param=param)
    return GuidedSpec("regex" if name == "guided_regex" else "grammar", value, param)


def _structured_outputs(value: Any) -> GuidedSpec:
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, structural_tag
    or json_object: true. `disable_any_whitespace: true` leaves JSON no whitespace of its own choosing
    (the other kinds ignore it, as vLLM's xgrammar backend); `disable_fallback` and
    `disable_additional_properties` are accepted (xgrammar is the only backend here, and follows a
    schema strictly: no properties it does not list, whatever that option says)."""
    keys = ", ".join([*STRUCTURED_OUTPUT_KEYS, "json_object"])
    if not isinstance(value, dict):
        raise GuidedDecodingError(f"'structured_outputs' must be an object with one of {keys}, got "
                                  f"{json.dumps(value)[:100]}", param="structured_outputs")
    found: list[GuidedSpec] = []
    compact = False
    for key, v in value.items():
        param = f"structured_outputs.{key}"
        if v is None:
            continue
        if key in STRUCTURED_OUTPUT_KEYS:
            found.append(_guided_field(STRUCTURED_OUTPUT_KEYS[key], v, param))
        elif key in ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(v, bool):
                raise GuidedDecodingError(f"'{param}' must be true or false, got {json.dumps(v)[:100]}", param=param)
            if key == "json_object" and v:
                found.append(GuidedSpec("json_object", "", param))
            compact = compact or (key == "disable_any_whitespace" and v)
        else:
            raise GuidedDecodingError(f"'{param}' is not supported by this server; structured_outputs takes one of "
                                      f"{keys} (and disable_any_whitespace, disable_fallback, "
                                      "disable_additional_properties)", param=param)
    if len(found) != 1:
        given = " and ".join(f"'{f.param}'" for f in found)
        raise GuidedDecodingError(f"'structured_outputs' must set exactly one of {keys}, got "
                                  f"{given + ' together' if found else 'none'}", param="structured_outputs")
    if compact and found[0].kind in ("json", "json_object"):
        return dataclasses.replace(found[0], any_whitespace=False)
    return found[0]


def _one(body: dict, name: str) -> GuidedSpec | None:
    value = body.get(name)
    if value is None:
        return None
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _guided_field(name, value, name)


def parse_guided(body: dict) -> GuidedSpec | None:
    """The request body's output constraint, or None (also for response_format text). More than
    one constraining field, or a malformed one, is a GuidedDecodingError naming the field."""
    found: list[tuple[str, GuidedSpec]] = []
    for name in GUIDED_FIELDS:
        spec = _one(body, name)
        if spec is not None:
            found.append((name, spec))
    if len(found) > 1:
        (a, _), (b, _) = found[:2]
        raise GuidedDecodingError(f"'{a}' and '{b}' both constrain the output; send at most one of them", param=b)
    return found[0][1] if found else None
