"""The project describes what meshd does, never how it was made.

Every file git tracks (code, comments, docstrings, tests, benchmarks, docs, examples,
packaging) is read for words that belong to a development log rather than to the software:
numbered work items and tracker entries of this project, notes about which machine someone
was given for a while, and commit hashes. Such words age the moment they are written and mean
nothing to a user; the fact they carried is said without the history instead. References to
other projects' trackers name the project first ("exo #2070"), which these rules do not
match.

README.md is a user guide: short, and it starts with the two commands a fresh machine needs.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]

# What a development log says and a user guide does not. Word boundaries keep "excellent",
# "nonstop" and "tissues" out.
PROCESS_WORDS: dict[str, re.Pattern[str]] = {
    "a numbered stop": re.compile(r"\bstops? \d+", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    "a closing note": re.compile(r"\bclosing notes?\b", re.IGNORECASE),
    "a device machine": re.compile(r"\bdevice machines?\b", re.IGNORECASE),
    "something lent": re.compile(r"\blent\b", re.IGNORECASE),
    "something borrowed": re.compile(r"\bborrowed\b", re.IGNORECASE),
    # A 7-40 digit hex hash (with at least one digit, so words such as "defaced" do not
    # count) just before or after the word "commit".
    "a commit hash": re.compile(
        r"\bcommit\w*\W{1,3}(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
        r"|\b(?=[0-9a-f]*\d)[0-9a-f]{7,40}\W{1,3}commit",
        re.IGNORECASE,
    ),
}

# Files the project does not write: generated protobuf modules, npm's lock file and the
# dashboard's vendored libraries.
NOT_OURS = (
    re.compile(r"_pb2(_grpc)?\.pyi?$"),
    re.compile(r"^examples/node-client/package-lock\.json$"),
    re.compile(r"(^|/)static/vendor/"),
)

# This file spells out the words it looks for (its samples above all), so it is not scanned.
THIS_FILE = Path(__file__).resolve().relative_to(ROOT).as_posix()

FRESH_MACHINE_COMMANDS = (
    "bash packaging/install.sh && .venv/bin/meshd demo"
    "                 # install, then a 3-node mesh answers a question",
    "bash packaging/install.sh --dev && .venv/bin/python -m pytest -q"
    "  # install with the test tooling, then run every test",
)
README_MAX_LINES = 300


def tracked_files() -> list[str]:
    """Paths git tracks, relative to the repository root."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        )
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): the tracked files cannot be listed")
    return [path for path in listed.stdout.decode().split("\0") if path]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (NUL bytes, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def process_words_in(text: str) -> list[tuple[int, str, str]]:
    """(line number, what was found, the line) for each development-process word."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern in PROCESS_WORDS.items():
            if pattern.search(line):
                hits.append((number, what, line.strip()))
    return hits


@pytest.mark.parametrize(
    "line",
    [
        f"measured in stop {35} on a quiet hour",
        f"the plan of stops {30}-31",
        f"Issue {11} asks for a hop under 0.5 ms",
        f"(issue #{9})",
        "the closing note has the tables",
        "the device machine below",
        "a machine lent for a while",
        "on the borrowed host",
        f"1.89 s at commit {'ef64a10'}",
        f"{'5b023cc'} (commit) moved it",
    ],
)
def test_the_scan_finds_process_words(line: str) -> None:
    assert process_words_in(line), f"no process word found in {line!r}"


@pytest.mark.parametrize(
    "line",
    [
        "an excellent link; the tissues of the mesh; a nonstop stream",
        "exo #2070 reports it; mlx #3910 fixed it",
        "`--stop` strings end a request; the request stops at a stop string",
        "the agreement committed plan 3 after 0.12 s",
        "a TLS session, a D-Bus session, the peer's session",
        "the hash deadbeefcafe of a model part",
    ],
)
def test_the_scan_leaves_plain_words_alone(line: str) -> None:
    assert process_words_in(line) == []


def test_no_file_speaks_of_how_the_project_was_made() -> None:
    found = []
    for relative in tracked_files():
        if any(pattern.search(relative) for pattern in NOT_OURS) or relative == THIS_FILE:
            continue
        path = ROOT / relative
        if not path.is_file():
            continue  # deleted in the working tree, not yet in the index
        text = text_of(path)
        if text is None:
            continue
        found += [f"{relative}:{n}: ({what}) {line}" for n, what, line in process_words_in(text)]
    assert not found, (
        "development-process words (say the fact without the history, or drop it):\n"
        + "\n".join(found)
    )


def test_the_readme_is_a_short_guide_that_starts_with_the_fresh_machine_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move reference "
        "material and measurements into docs/"
    )
    assert lines[:6] == ["# meshd", "", "```sh", *FRESH_MACHINE_COMMANDS, "```"], (
        "README.md must start with its title and the two commands for a fresh machine, "
        f"exactly:\n{chr(10).join(FRESH_MACHINE_COMMANDS)}\nit starts:\n" + "\n".join(lines[:6])
    )
