"""The rule that keeps the front-door docs' commands running (tests/docs_blocks.py).

The docs themselves must follow it (every block tagged, every ``sh`` block run by
tests/host/test_docs_run.py or claimed by a file that runs it as written); the checks
must catch a block that breaks it; the substitutions must change only ports and the
example paths.
"""

from __future__ import annotations

from pathlib import Path

from tests.docs_blocks import (
    DOCS,
    ROOT,
    all_problems,
    blocks,
    ports,
    problems,
    run_map,
    script,
    substituted,
)


def test_the_docs_follow_the_rule() -> None:
    assert all_problems() == []


def test_each_doc_has_commands_the_doc_test_runs() -> None:
    expected = {"README.md": ("kvbeam demo",),
                "docs/vllm.md": ("kvbeam prefill", "kvbeam decode",
                                 "vllm.entrypoints.openai.api_server", "vllm-router",
                                 "/v1/completions"),
                "docs/sglang.md": ("kvbeam prefill", "kvbeam decode", "sglang.launch_server",
                                   "sglang_router.launch_router", "--mini-lb", "/generate")}
    assert set(expected) == set(DOCS)
    for doc, words in expected.items():
        text = script(doc)
        for word in words:
            assert word in text, (doc, word)


def test_a_claimed_block_is_run_by_its_claimer() -> None:
    claimed = [b for doc in DOCS for b in blocks(doc) if b.claim]
    assert [(b.doc, b.claim) for b in claimed] == [("README.md", ".ci/run")]
    assert "make test" in (ROOT / ".ci/run").read_text()
    assert "make test" not in script("README.md")  # claimed: not run again by the doc test


def test_blocks_that_break_the_rule_are_named(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("\n".join([
        "# a doc", "", "```", "kvbeam demo", "```", "",  # no tag
        "```bash", "kvbeam demo", "```", "",  # not a tag of the rule
        "<!-- run by: .ci/run -->", "```sh", "make demo", "```", "",  # not in .ci/run
        "<!-- run by: no/such/file -->", "```sh", "make test", "```", "",
        "<!-- run by: .ci/run -->", "```text", "make test", "```", "",  # not a command
        "<!-- run by: .ci/run -->", "```sh", "make test   # CI", "```", "",  # fine
        "```sh", "kvbeam demo --transport tcp", "```", ""]))  # fine: the doc test runs it
    found = problems(str(doc))
    assert [p.split(": ", 1)[0].rsplit(":", 1)[1] for p in found] == ["3", "7", "12", "17",
                                                                      "22"], found
    assert "without a tag" in found[0] and "unknown tag 'bash'" in found[1], found
    assert "does not run 'make demo' as written" in found[2], found
    assert "not a file here" in found[3] and "only commands are claimed" in found[4], found
    assert script(str(doc)) == "kvbeam demo --transport tcp\n"


def test_a_run_changes_ports_and_example_paths_only(tmp_path: Path) -> None:
    text = ("kvbeam prefill --listen 127.0.0.1:50051 --attach-socket /run/kvbeam/p.sock &\n"
            "curl -s http://127.0.0.1:8000/v1/completions -d '{\"prompt\": [50051, 8000]}'\n"
            "launch --port 8100 --disaggregation-bootstrap-port 8998 --prefill URL 8998\n"
            "cat /etc/kvbeam/token > /tmp/kvbeam-try/x; echo 10.0.0.1 1.8000\n")
    assert ports(text) == [50051, 8000, 8100, 8998]
    port_map, path_map = run_map(text, tmp_path)
    assert len(set(port_map.values())) == 4 and not set(port_map) & set(port_map.values())
    out = substituted(text, port_map, path_map)
    p = {k: str(v) for k, v in port_map.items()}
    assert out == (
        f"kvbeam prefill --listen 127.0.0.1:{p[50051]} --attach-socket "
        f"{tmp_path}/run-kvbeam/p.sock &\n"
        f"curl -s http://127.0.0.1:{p[8000]}/v1/completions -d '{{\"prompt\": "
        f"[{p[50051]}, {p[8000]}]}}'\n"
        f"launch --port {p[8100]} --disaggregation-bootstrap-port {p[8998]} --prefill URL "
        f"{p[8998]}\n"
        f"cat {tmp_path}/etc-kvbeam/token > {tmp_path}/tmp-kvbeam-try/x; echo 10.0.0.1 1.8000\n")
