"""The README's commands stay runnable as written: every ``jha`` command line of its shell blocks parses with
``jha``'s own parser, every script it names exists, and every Python block compiles. (Running them all is a
fresh clone's job: they load models and compile.)"""

import re
import shlex
from pathlib import Path

import pytest

from jax_hybrid_attn.cli import build_parser

README = Path(__file__).parent.parent / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text()) if lang == language]


def shell_commands() -> list[list[str]]:
    """Each command of the README's bash blocks as words: comments and environment assignments dropped, ``$MODEL``
    given a value, continued lines joined."""
    commands = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.replace("$MODEL", "tiny-hybrid"), comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words and words[-1] == "&":
                words = words[:-1]
            if words:
                commands.append(words)
    return commands


def test_every_jha_command_of_the_readme_parses():
    commands = [words for words in shell_commands() if words[0] == "jha"]
    assert len(commands) >= 9
    parser = build_parser()
    for words in commands:
        if words[1:] == ["--version"]:
            continue
        try:
            parser.parse_args(words[1:])
        except SystemExit as error:
            pytest.fail(f"{shlex.join(words)}: argparse exit {error.code}")


def test_every_script_the_readme_runs_exists():
    root = README.parent
    scripts = [words[0] for words in shell_commands() if words[0].startswith("scripts/")]
    assert "scripts/demo" in scripts and "scripts/test" in scripts
    for script in scripts:
        assert (root / script).is_file(), script


def test_every_python_block_of_the_readme_compiles():
    python = blocks("python")
    assert python
    for i, code in enumerate(python):
        compile(code, f"README.md python block {i}", "exec")
