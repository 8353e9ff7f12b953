"""The documentation as a contract: every command README.md, ARCHITECTURE.md and the files under
docs/ show is read from them and either run or, where running it here is out of reach, checked
against the tool's own ``--help``.

- Every option any documented command names (the README's synopsis included) exists in its
  command's ``--help``.
- Fenced and inline commands without placeholders (an UPPERCASE word such as ``PACKAGE``, ``[``,
  ``|`` or ``...``) run from a scratch folder per file, in that file's order (the export before the
  ``check`` of its package), and exit 0. Two kinds are replaced, each said in the test: a full-size
  ``gemma-4-e2b`` export (minutes and GiBs) runs as ``plan`` with the same arguments (the model
  resolved, every option parsed and checked, no tracing); a benchmark runs when its model is a tiny
  preset on the CPU, else only its options are checked.
- The README's first runnable command is the tiny-gemma-4 export of its set-up, and it checks a
  package it made.
- CI (``.ci/run``) runs the README's test command, word for word.
- Every relative link in those files points at a file that exists, and at a heading of it that
  exists where the link names one.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.l1
ROOT = Path(__file__).resolve().parents[1]
DOC_PATHS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCS = {path.relative_to(ROOT).as_posix(): path.read_text() for path in DOC_PATHS}
README = DOCS["README.md"]
_PROGRAMS = ("python -m exporter", "genai-exporter", "python scripts/")
# Benchmarks that need WebGPU (or its capture) are only option-checked.
_WEBGPU_BENCHMARK_OPTIONS = {"--graph-capture", "--max-lengths", "--attention-routing"}


def _fenced_lines_of(match: re.Match) -> list[str]:
    if match.group(1) not in ("", "bash"):
        return []
    lines = []
    for line in match.group(2).splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        lines += [part.strip() for part in line.split("&&")]
    return lines


def _fenced_lines(text: str) -> list[str]:
    lines = [line for match in re.finditer(r"```(\w*)\n(.*?)```", text, re.S) for line in _fenced_lines_of(match)]
    return [line for line in lines if line.startswith(_PROGRAMS)]


def _inline_commands(text: str) -> list[str]:
    return [c for c in re.findall(r"`([^`\n]+)`", text) if c.startswith(_PROGRAMS) and not c.endswith("...")]


def _synopsis_continuations(text: str) -> list[str]:
    """A synopsis's wrapped lines (options only), joined to the command they continue."""
    block = re.search(r"## Command line\n\n```\n(.*?)```", text, re.S)
    commands: list[str] = []
    for line in block.group(1).splitlines() if block else []:
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line.startswith(_PROGRAMS):
            commands.append(line)
        elif line and commands:
            commands[-1] += " " + line
    return commands


def _has_placeholder(command: str) -> bool:
    return bool(re.search(r"\b[A-Z][A-Z0-9_]+\b|\[|\||\.\.\.", command))


def _subcommand(words: list[str]) -> tuple[list[str], list[str]]:
    """(the program's argv up to the subcommand, the rest) for ``python -m exporter`` or a script."""
    if words[:3] == ["python", "-m", "exporter"]:
        program, rest = [sys.executable, "-m", "exporter"], words[3:]
    elif words[0] == "genai-exporter":
        program, rest = [sys.executable, "-m", "exporter"], words[1:]
    else:
        program, rest = [sys.executable, str(ROOT / words[1])], words[2:]
    if rest[:1] and rest[0] in ("list", "plan", "check"):
        program, rest = program + rest[:1], rest[1:]
    return program, rest


def _help(program: tuple[str, ...], cache: dict = {}) -> str:  # noqa: B006 (a cache on purpose)
    if program not in cache:
        done = subprocess.run([*program, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        cache[program] = done.stdout
    return cache[program]


def _commands(text: str) -> set[str]:
    return set(_fenced_lines(text) + _inline_commands(text) + _synopsis_continuations(text))


# Each command once, with the files that show it.
SHOWN_IN: dict[str, list[str]] = {}
for _doc, _text in DOCS.items():
    for _command in _commands(_text):
        SHOWN_IN.setdefault(_command, []).append(_doc)
ALL_COMMANDS = sorted(SHOWN_IN)


def test_the_readme_shows_commands():
    readme = _commands(README)
    assert _synopsis_continuations(README), "README.md has no '## Command line' synopsis block"
    assert any(c.startswith("python -m exporter tiny-gemma-4") for c in readme), readme
    assert any(c.startswith("python -m exporter check") for c in readme), readme
    assert any(c.startswith("python scripts/benchmark.py") for c in ALL_COMMANDS), ALL_COMMANDS
    assert all(DOCS[doc] for doc in DOCS if doc.startswith("docs/")), "an empty file under docs/"


@pytest.mark.parametrize("command", ALL_COMMANDS)
def test_every_option_the_docs_name_exists(command):
    program, rest = _subcommand(command.split())
    shown = _help(tuple(program)).split("\n\n")[0]  # the usage lines only: not options named in prose
    for option in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", " ".join(rest)):
        assert re.search(rf"(?<![\w-]){re.escape(option)}\b", shown), \
            f"{option} (in `{command}`, {', '.join(SHOWN_IN[command])}) is not in {' '.join(program[1:])} --help"


def _runnable(text: str) -> list[tuple[str, list[str]]]:
    """(the file's command, what runs) in the file's order, once each."""
    seen, runs = set(), []
    for match in re.finditer(r"```(\w*)\n(.*?)```|`([^`\n]+)`", text, re.S):
        lines = _fenced_lines_of(match) if match.group(2) is not None else [match.group(3)]
        for command in lines:
            if command in seen or not command.startswith(_PROGRAMS) or _has_placeholder(command):
                continue
            seen.add(command)
            program, rest = _subcommand(shlex.split(command))
            if program[-1] == "check" and all(word.startswith("-") for word in rest[:1]):
                continue  # a fragment in prose (`check --ep webgpu`): no package named, options checked above
            if program[-1].endswith("scripts/benchmark.py"):
                if not (rest and rest[0].startswith("tiny-") and not _WEBGPU_BENCHMARK_OPTIONS & set(rest)):
                    continue  # full-size or WebGPU benchmarks: options checked above
                runs.append((command, [*program, *rest, "--output", "benchmark.md"]))
            elif program[-1] == "exporter" and rest and rest[0] == "gemma-4-e2b":
                runs.append((command, [*program, "plan", *[w for w in rest if w != "--random-weights"]]))
            else:
                runs.append((command, [*program, *rest]))
    return runs


RUNNABLE = {doc: runs for doc, text in DOCS.items() if (runs := _runnable(text))}


def test_the_readme_runs_its_own_export_first():
    assert [c for c, _ in RUNNABLE["README.md"]][:1] == ["python -m exporter tiny-gemma-4 -o out/tiny-gemma-4 --overwrite"]
    assert any(c.startswith("python -m exporter check out/") for c, _ in RUNNABLE["README.md"])


@pytest.mark.parametrize("doc", sorted(RUNNABLE))
def test_every_runnable_command_exits_0(doc, tmp_path):
    for command, argv in RUNNABLE[doc]:
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"`{command}` ({doc}) exited {done.returncode}: {done.stderr.strip()[-2000:]}"


def test_ci_runs_the_readme_test_command():
    test_command = next(line for line in re.findall(r"```bash\n(.*?)```", README, re.S)[0].splitlines()
                        if "pytest" in line).strip()
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _without_code_blocks(text), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def _relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", _without_code_blocks(text))
    return [link for link in links if not re.match(r"[a-z][a-z0-9+.-]*:", link)]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_relative_link_resolves(doc):
    broken = []
    for link in _relative_links(DOCS[doc]):
        path, _, anchor = link.partition("#")
        target = ((ROOT / doc).parent / path).resolve() if path else ROOT / doc
        if not target.exists():
            broken.append(f"{link}: no {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target.read_text()):
            broken.append(f"{link}: no heading '#{anchor}' in {target.relative_to(ROOT)}")
    assert broken == []


def test_the_console_script_names_itself():
    script = Path(sys.executable).parent / "genai-exporter"
    if not script.is_file():
        pytest.skip("the console script is not installed beside this Python")
    for argv, usage in ((["--help"], "usage: genai-exporter "), (["list", "--help"], "usage: genai-exporter list")):
        done = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.startswith(usage), done.stdout[:200]
