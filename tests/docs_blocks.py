"""The command blocks of the front-door docs, and the rule that keeps them running.

The rule (README.md's Quick start says it; tests/unit/test_docs_blocks.py checks it):

- Every fenced block of :data:`DOCS` has a tag. ``sh``: commands. ``text``, ``yaml``,
  ``json``, ``python``: not commands (output, configs, an API sketch).
- Every ``sh`` block is run by tests/host/test_docs_run.py exactly as written: a doc's
  ``sh`` blocks, in order, are one bash script (its servers started with ``&``, its
  waits written out), run from the repository root, with only ports and the example
  paths substituted (:func:`substituted`).
- Or the block is claimed, on the line right above it, by ``<!-- run by: FILE -->``: a
  file of this repository (CI's own entry point, a test) that contains every command
  line of the block as written. The claim is checked; nothing else may claim a block.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The docs whose command blocks run (README: test-host; vllm.md: test-vllm; sglang.md:
#: test-sglang).
DOCS = ("README.md", "docs/vllm.md", "docs/sglang.md")
COMMANDS = "sh"
#: Tags of blocks that are not commands.
NOT_COMMANDS = frozenset({"text", "yaml", "json", "python"})
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_CLAIM = re.compile(r"^<!-- run by: (\S+) -->$")
#: The example paths a doc's commands use, and what they become in a run (under its
#: temporary folder): a socket folder, a credentials folder, a scratch folder.
EXAMPLE_PATHS = ("/run/kvbeam", "/etc/kvbeam", "/tmp/kvbeam-try")
#: Where a port appears in a command: after a host and colon, or after a port flag.
_PORTS = re.compile(r"(?:\d+\.\d+\.\d+\.\d+|localhost):(\d{2,5})\b"
                    r"|--(?:[a-z-]+-)?port[ =](\d{2,5})\b")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of its fence), its tag, its text
    and the file that claims it (None: run by the doc test, or not a command)."""

    doc: str
    line: int
    tag: str
    text: str
    claim: str | None = None

    @property
    def commands(self) -> bool:
        """Whether it is a command block."""
        return self.tag == COMMANDS


def blocks(doc: str) -> list[Block]:
    """Every fenced block of ``doc`` (a path relative to the repository root)."""
    lines = (ROOT / doc).read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, tag, start = m.group(1), m.group(2), i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()),
                     "")
        claim = _CLAIM.match(above)
        out.append(Block(doc, start + 1, tag, "\n".join(body) + "\n",
                         claim.group(1) if claim else None))
        i += 1
    return out


def command_lines(text: str) -> list[str]:
    """A block's commands, one per line as written (comment lines and blank lines out)."""
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def problems(doc: str) -> list[str]:
    """What breaks the rule in ``doc``, each naming the block's line (empty: none)."""
    out = []
    for b in blocks(doc):
        where = f"{doc}:{b.line}"
        if not b.tag:
            out.append(f"{where}: a fenced block without a tag: ```sh (commands, run by "
                       f"tests/host/test_docs_run.py) or one of {sorted(NOT_COMMANDS)}")
        elif b.tag != COMMANDS and b.tag not in NOT_COMMANDS:
            out.append(f"{where}: unknown tag {b.tag!r}: ```sh or one of "
                       f"{sorted(NOT_COMMANDS)}")
        elif b.claim is not None and not b.commands:
            out.append(f"{where}: a claim on a ```{b.tag} block: only commands are claimed")
        elif b.claim is not None:
            claimer = ROOT / b.claim
            if not claimer.is_file():
                out.append(f"{where}: claimed by {b.claim}, which is not a file here")
                continue
            text = claimer.read_text(encoding="utf-8")
            missing = [c for c in command_lines(b.text) if c.split(" #")[0].strip() not in text]
            if missing:
                out.append(f"{where}: claimed by {b.claim}, which does not run "
                           f"{missing[0]!r} as written")
    return out


def script(doc: str) -> str:
    """The doc's unclaimed command blocks, in order: the script the doc test runs."""
    return "".join(b.text for b in blocks(doc) if b.commands and b.claim is None)


def ports(text: str) -> list[int]:
    """The ports a script's commands name (see :data:`_PORTS`), each once, in order."""
    found: list[int] = []
    for m in _PORTS.finditer(text):
        port = int(m.group(1) or m.group(2))
        if port not in found:
            found.append(port)
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports nothing listens on now (loopback)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def substituted(text: str, port_map: Mapping[int, int], path_map: Mapping[str, str]) -> str:
    """``text`` with every example path and every mapped port (as a whole number, not a
    part of an address or of another number) replaced: the only changes a run makes."""
    for old, new in path_map.items():
        text = text.replace(old, new)
    if port_map:
        pattern = re.compile(r"(?<![\d.])(" + "|".join(str(p) for p in port_map) + r")(?![\d.])")
        text = pattern.sub(lambda m: str(port_map[int(m.group(1))]), text)
    return text


def run_map(text: str, work: Path) -> tuple[dict[int, int], dict[str, str]]:
    """The substitutions of one run: a free port for each port ``text`` names, and each
    example path under ``work``."""
    named = ports(text)
    return (dict(zip(named, free_ports(len(named)), strict=True)),
            {p: str(work / p.strip("/").replace("/", "-")) for p in EXAMPLE_PATHS})


def all_problems(docs: Iterable[str] = DOCS) -> list[str]:
    """:func:`problems` of every doc."""
    return [p for doc in docs for p in problems(doc)]
