"""The command blocks of README.md, docs/vllm.md and docs/sglang.md, run as written.

Each doc's ``sh`` blocks, in order, are one bash script (tests/docs_blocks.py: the
rule, the extraction and the only substitutions: a free port for each port the
commands name, the example folders under a temporary one). It runs from the repository
root with ``bash -e -o pipefail``, in its own process group, its output in a file; the
servers it starts with ``&`` are stopped with the group afterwards. A doc whose
commands drift (a flag renamed, a step missing) fails here: the script exits non-zero
or never answers.

- README.md (``make test-host``): the quick start, reference engines through two
  daemons over TCP, every continuation equal to the colocated run.
- docs/vllm.md (``make test-vllm``, from .venv-vllm): two kvbeam daemons, two ``vllm
  serve`` and vllm-router; the completion through the router must carry its tokens and
  both daemons must log the transfer's Success, verified on decode.
- docs/sglang.md (``make test-sglang``, from .venv-sglang): two daemons, sglang's
  prefill and decode servers, sglang's Rust PD router and its mini load balancer; a
  generation through each must carry its tokens, each moved by kvbeam and verified.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.docs_blocks import ROOT, run_map, script, substituted
from tests.vllm_helpers import require_vllm

#: Each doc's budget, s: its servers start on a loaded 2-core machine.
BUDGET_S = {"README.md": 300.0, "docs/vllm.md": 1500.0, "docs/sglang.md": 1800.0}

HAVE_SGLANG_SERVER = all(importlib.util.find_spec(m) is not None
                         for m in ("sglang", "sglang_router", "safetensors", "uvicorn"))
if not HAVE_SGLANG_SERVER and os.environ.get("KVBEAM_REQUIRE_SGLANG_SERVER") == "1":
    raise RuntimeError("KVBEAM_REQUIRE_SGLANG_SERVER=1 but the sglang server venv is not "
                       "this interpreter's (make test-sglang)")
needs_sglang_server = pytest.mark.skipif(
    not HAVE_SGLANG_SERVER, reason="sglang's server stack is not installed (make test-sglang)")


@dataclass
class DocRun:
    """A doc's script that ran: its exit status (None: past its budget) and its output."""

    doc: str
    returncode: int | None
    log: Path
    seconds: float

    def output(self) -> str:
        """Everything the script and what it started printed so far."""
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 80) -> str:
        """The last lines of the output, for failure messages."""
        return f"{self.doc} (exit {self.returncode}, {self.seconds:.0f} s):\n" + \
            "".join(self.output().splitlines(keepends=True)[-lines:])

    def wait_for(self, pattern: str, count: int = 1,
                 timeout: float = 15.0) -> list[re.Match[str]]:
        """Every match of ``pattern`` once there are ``count`` (a daemon's end line comes
        up to one sweep after the transfer ended), or all there are after ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            found = list(re.finditer(pattern, self.output()))
            if len(found) >= count or time.monotonic() > end:
                return found
            time.sleep(0.5)


def _environment() -> dict[str, str]:
    """The test's environment without kvbeam's daemon settings (the conftest turns
    --log-requests on for the tests' own daemons; the docs' run as users' do) or an
    active venv (the scripts activate their own)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("KVBEAM_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}


@contextlib.contextmanager
def doc_run(doc: str, text: str | None = None) -> Iterator[DocRun]:
    """Run ``doc``'s script (or ``text`` in its place) until it exits; yield what it did
    while the servers it started still run; then stop them all (SIGTERM to the group,
    SIGKILL after 30 s) and remove the folder."""
    text = script(doc) if text is None else text
    with tempfile.TemporaryDirectory(prefix="kvbeam-docs-") as tmp:  # short: socket paths
        work = Path(tmp)
        port_map, path_map = run_map(text, work)
        path = work / "script.sh"
        path.write_text(substituted(text, port_map, path_map))
        log = work / "output.log"
        began = time.monotonic()
        with log.open("w") as out:
            proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", str(path)], cwd=ROOT,
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=_environment(), start_new_session=True)
        try:
            try:
                code: int | None = proc.wait(BUDGET_S.get(doc, 300.0))
            except subprocess.TimeoutExpired:
                code = None
            yield DocRun(doc, code, log, time.monotonic() - began)
        finally:
            _stop_group(proc)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the script's process group (what it started with ``&`` is in it), SIGKILL
    whatever is left after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _json_after(text: str, start: str) -> list[dict[str, Any]]:
    """Every JSON object in ``text`` that begins with ``start`` (curl prints an answer
    without a newline: a log line may follow it on the same line)."""
    out = []
    decoder = json.JSONDecoder()
    for m in re.finditer(re.escape(start), text):
        with contextlib.suppress(ValueError):
            out.append(decoder.raw_decode(text, m.start())[0])
    return out


def _moved_and_verified(run: DocRun) -> None:
    """Both daemons logged a transfer's end: decode's Success verified, prefill's sent."""
    landed = run.wait_for(r"kvbeam\.transfers: request (\S+): Success, (\d+)/\2 bytes "
                          r"landed in [\d.]+ ms; XXH3-128 verified: ")
    assert landed and int(landed[0].group(2)) > 0, run.tail()
    print(f"\n{run.doc}: {landed[0].group(0)}")
    rid = landed[0].group(1)
    assert run.wait_for(rf"kvbeam\.transfers: request {re.escape(rid)}: Success, (\d+)/\1 "
                        r"bytes written in "), run.tail()


def test_readme_commands_run_as_written() -> None:
    with doc_run("README.md") as run:
        assert run.returncode == 0, run.tail()
        out = run.output()
    assert re.search(r"^(\d+)/\1 continuations equal to the colocated run", out, re.M), \
        run.tail()


def test_a_drifted_command_fails_the_run() -> None:
    """The negative control: the README's script with one flag renamed (a doc that
    drifted from the CLI) exits non-zero, naming the flag."""
    text = script("README.md")
    assert "--transport tcp" in text
    with doc_run("README.md", text.replace("--transport tcp", "--transport-kind tcp")) as run:
        assert run.returncode not in (0, None), run.tail()
        assert "--transport-kind" in run.output(), run.tail()


@require_vllm("vllm", "vllm_router")
def test_vllm_commands_run_as_written() -> None:
    with doc_run("docs/vllm.md") as run:
        assert run.returncode == 0, run.tail()
        answers = _json_after(run.output(), '{"id":"cmpl-')
        assert answers, run.tail()
        choice = answers[-1]["choices"][0]
        assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length", answers
        _moved_and_verified(run)
        print(f"\ndocs/vllm.md ran in {run.seconds:.0f} s")


@needs_sglang_server
def test_sglang_commands_run_as_written() -> None:
    with doc_run("docs/sglang.md") as run:
        assert run.returncode == 0, run.tail()
        answers = _json_after(run.output(), '{"output_ids":')
        assert len(answers) >= 2, run.tail()  # one through each router
        for answer in answers:
            assert len(answer["output_ids"]) == 8, answers
        _moved_and_verified(run)
        ends = run.wait_for(r"kvbeam\.transfers: request \S+: Success, (\d+)/\1 bytes landed",
                            count=len(answers))
        assert len(ends) >= len(answers), run.tail()  # each answer's KV moved by kvbeam
        print(f"\ndocs/sglang.md ran in {run.seconds:.0f} s")
