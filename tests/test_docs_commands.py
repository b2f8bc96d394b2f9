"""The `resident ...` command lines the docs and deployment files tell users to run still parse
against the CLI: every subcommand exists, every flag exists with that spelling and takes that
kind of value, and choices are valid. Each line goes through click's own parsing
(`make_context(..., resilient_parsing=False)`), nothing is run; no torch import.

Sources: the fenced code blocks of README.md, docs/*.md and docs/kubernetes/README.md, the
Exec*= lines of systemd/*.service (with the unit's Environment= values substituted) and the
containers' `command:` of docs/kubernetes/*.yaml (with the container's env substituted).
A line with a placeholder that cannot parse is listed in PLACEHOLDERS below, with why."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from resident.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
MARKDOWN = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "docs" / "kubernetes" / "README.md")
K8S = ROOT / "docs" / "kubernetes"

#: Fenced-code lines (after joining `\` continuations, stripped) that are not meant to parse as
#: written: they show alternatives or optional parts in a usage notation.
PLACEHOLDERS = {
    # `[MODEL]` is optional and `cpu|cuda` a choice between two values.
    "resident bench speculative [MODEL] --device cpu|cuda --batch-sizes 1,8 --json out.json",
}

_SEPARATORS = {"&&", "||", ";", "|", "&"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _fenced_lines(path: Path) -> list[str]:
    """The lines inside ``` blocks, `\\`-continued lines joined."""
    lines: list[str] = []
    inside, pending = False, ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        lines.append(line)
    return lines


def _resident_commands(line: str) -> list[list[str]]:
    """The argument lists (after the program name) of every `resident` command in a shell line:
    `.ci/setup && .venv/bin/resident demo` -> [["demo"]]; comments and VAR=value prefixes dropped."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lex.whitespace_split = True
    commands, words = [], []
    for token in [*lex, ";"]:
        if token not in _SEPARATORS:
            words.append(token)
            continue
        while words and _ASSIGNMENT.match(words[0]):
            words.pop(0)
        if words and words[0] == "sudo":
            words.pop(0)
        if words and Path(words[0]).name == "resident":
            commands.append(words[1:])
        words = []
    return commands


def _markdown_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in MARKDOWN:
        for line in _fenced_lines(path):
            if line in PLACEHOLDERS:
                continue
            for args in _resident_commands(line):
                out.append((f"{path.relative_to(ROOT)}: {line}", args))
    return out


def _substitute(word: str, env: dict[str, str], pattern: str) -> str:
    def value(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name not in env:
            raise AssertionError(f"{word!r} names ${name}, which the file never sets")
        return env[name]

    return re.sub(pattern, value, word)


def _unit_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in sorted((ROOT / "systemd").glob("*.service")):
        env: dict[str, str] = {}
        execs: list[str] = []
        for line in path.read_text().splitlines():
            key, sep, value = line.strip().partition("=")
            if not sep or line.lstrip().startswith("#"):
                continue
            if key == "Environment":
                for assignment in shlex.split(value):
                    name, _, v = assignment.partition("=")
                    env[name] = v
            elif key.startswith("Exec"):
                execs.append(value.lstrip("-@:+!"))
        for value in execs:
            words = shlex.split(value)
            if Path(words[0]).name == "resident":   # ${VAR} and $VAR as systemd expands them
                words = [_substitute(w, env, r"\$\{(\w+)\}|\$(\w+)") for w in words]
                out.append((f"{path.relative_to(ROOT)}: {value}", words[1:]))
    return out


def _kubernetes_commands() -> list[tuple[str, list[str]]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the Kubernetes manifests")
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            pod = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []):
                command = [str(w) for w in container.get("command", [])]
                if not command or Path(command[0]).name != "resident":
                    continue
                env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
                words = [_substitute(w, env, r"\$\((\w+)\)") for w in command]
                out.append((f"{path.relative_to(ROOT)}: {' '.join(command)}", words[1:]))
    return out


def _parse(args: list[str]) -> click.Context:
    """click's parsing of `resident ARGS` down to the leaf command (types, choices, callbacks)."""
    command: click.Command = cli
    ctx = None
    name = "resident"
    while True:
        ctx = command.make_context(name, list(args), parent=ctx, resilient_parsing=False)
        if not isinstance(command, click.Group):
            return ctx
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            return ctx
        name, sub, args = command.resolve_command(ctx, rest)
        assert sub is not None, f"no subcommand {name!r}"
        command = sub


@pytest.fixture
def parse(tmp_path, monkeypatch):
    """_parse in an empty working folder (--json/--output callbacks probe writability), with the
    MODEL callbacks' existence check off: the docs name checkpoints that are not on this machine."""
    import resident.daemon.source as source

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(source, "resolve_model", lambda *a, **k: None)
    return _parse


def _check(parse, where: str, args: list[str]) -> None:
    try:
        parse(args)
    except click.exceptions.Exit as e:   # --help / --version: only fine when asked for
        assert e.exit_code == 0, f"{where}: exits {e.exit_code}"
    except click.ClickException as e:
        pytest.fail(f"{where}\n  does not parse: {e.format_message()}")


def test_readme_and_docs_code_blocks_parse(parse):
    commands = _markdown_commands()
    readme = [c for c in commands if c[0].startswith("README.md")]
    assert len(readme) >= 10, "the README's fenced `resident ...` lines were not found"
    for where, args in commands:
        _check(parse, where, args)


def test_systemd_exec_lines_parse(parse):
    commands = _unit_commands()
    assert {w.split(":")[0] for w, _ in commands} == {"systemd/resident-engine.service",
                                                       "systemd/resident-preload.service"}
    for where, args in commands:
        _check(parse, where, args)


def test_kubernetes_container_commands_parse(parse):
    commands = _kubernetes_commands()
    assert len(commands) == 2, commands   # the preload DaemonSet and the engine Deployment
    for where, args in commands:
        _check(parse, where, args)


def test_placeholders_are_still_in_the_docs():
    """A PLACEHOLDERS entry whose line left the docs would silently skip nothing: drop it."""
    lines = {line for path in MARKDOWN for line in _fenced_lines(path)}
    assert PLACEHOLDERS <= lines, PLACEHOLDERS - lines


@pytest.mark.parametrize("args", [["serve", "M", "--no-such-flag"], ["preload", "start", "--http"],
                                  ["serve", "M", "--preload", "sometimes"], ["no-such-command"],
                                  ["rollout", "--port", "eighty"]])
def test_drift_would_be_caught(parse, args):
    with pytest.raises(click.ClickException):
        parse(args)
