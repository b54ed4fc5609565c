"""sglang's own servers, kvbeam daemons and sglang's router for tests/host/test_sglang_server.py.

Runs in the sglang server venv (``make test-sglang``: .venv-sglang). Everything starts
as the documented commands (docs/sglang.md "Running it"), each a subprocess whose
output goes to a log file under the test's folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbeam.pools.sglang_mha import sglang_mha_spec
from kvbeam.pools.spec import SideConfig
from kvbeam.proto.attach_codec import config_to_mapping

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "tests" / "sglang_server" / "stubs"
#: What a served sglang test needs in the interpreter running pytest (.venv-sglang).
SERVER_MODULES = ("sglang", "sglang_router", "safetensors", "uvicorn")


def require_sglang_server() -> pytest.MarkDecorator:
    """A served sglang test module's ``pytestmark``: skip it where sglang's server stack
    (:data:`SERVER_MODULES`) is not importable; with ``KVBEAM_REQUIRE_SGLANG_SERVER=1``
    (``make test-sglang``, CI) a missing one fails the module's collection instead, so a
    skip never passes for a run.

    Raises:
        RuntimeError: ``KVBEAM_REQUIRE_SGLANG_SERVER=1`` and a module is missing.
    """
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("KVBEAM_REQUIRE_SGLANG_SERVER") == "1":
        raise RuntimeError("KVBEAM_REQUIRE_SGLANG_SERVER=1 but the sglang server venv is not "
                           f"this interpreter's: {', '.join(missing)} missing (make test-sglang)")
    return pytest.mark.skipif(bool(missing), reason="sglang's server stack is not installed "
                              "(make test-sglang)")


#: A tiny Llama whose weights the test writes (seeded: with sglang's dummy weights the
#: output is a 2-token cycle that ignores the context).
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}
#: KV cache dtype sglang picks for this model on the CPU (``--dtype auto``).
KV_DTYPE = "float16"
#: The model's name as the servers serve it: the pools' description carries it, and the
#: daemons' handshake compares it.
MODEL_NAME = "tiny-llama"
MAX_TOTAL_TOKENS = 4096
MAX_RUNNING = 8
CHUNK = 256
PAGE_SIZE = 1
#: sglang 0.5.23's metadata rows (MetadataBuffers.get_buf_infos) for this model without
#: speculation: output ids, cached tokens, logprob value/index, top logprobs value/index,
#: top-k p, top-k index, hidden states (16 float32), bootstrap room.
AUX_ITEM_LENS = (64, 64, 64, 64, 512, 512, 64, 128, 64, 64)
#: Start-up budget of one server on a loaded 2-core machine.
START_S = 600.0

#: The flags every sglang server of the test runs with (the issue's CPU setup).
SGLANG_FLAGS = (
    "--skip-tokenizer-init", "--device", "cpu", "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch", "--disable-overlap-schedule",
    "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
    "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--max-running-requests", str(MAX_RUNNING),
    "--chunked-prefill-size", str(CHUNK), "--page-size", str(PAGE_SIZE),
    "--mem-fraction-static", "0.05", "--served-model-name", MODEL_NAME,
)


#: The served tests' prompt lengths: under one chunk (256 tokens), exactly one, and over
#: one (2 and 3 chunks); and the prompts sent several at once.
LENGTHS = (6, 100, 256, 300, 700)
IN_FLIGHT = tuple((n, s) for n in (50, 300) for s in (1, 2))
NEW_TOKENS = 16


def prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids (not special ones) from a seeded generator."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(n * 1000 + seed).integers(3, 1000, n)]


@dataclass
class PlainOutputs:
    """One plain sglang server's greedy ``output_ids`` of :func:`prompt` ``(n, seed)``,
    the model it served (the pairs serve the same folder) and its start-up seconds."""

    outputs: dict[tuple[int, int], list[int]]
    model: str
    ready_s: float


def plain_outputs(work: Path, keys: tuple[tuple[int, int], ...]) -> PlainOutputs:
    """Start one plain sglang server (same flags, no disaggregation), record its outputs
    of ``keys``, stop it (before any pair starts: an idle scheduler busy-polls a core)."""
    model = write_model(work / "model")
    port = free_port()
    server = sglang_server("plain", model, port, work / "plain.log")
    try:
        server.wait_for("The server is fired up")
        outputs = {}
        for n, s in keys:
            out = generate(port, prompt(n, s), NEW_TOKENS)
            assert "output_ids" in out, out
            outputs[(n, s)] = out["output_ids"]
    finally:
        server.stop()
    # Context matters with these weights: different prompts, different continuations.
    assert len({tuple(v) for v in outputs.values()}) == len(outputs), outputs
    return PlainOutputs(outputs, model, server.ready_s or 0.0)


def free_port() -> int:
    """A TCP port nothing listens on now (loopback)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model(directory: Path, config: dict[str, Any] | None = None) -> str:
    """The model folder: config.json and seeded weights (model.safetensors) of
    ``config`` (a Llama's; default the tiny one, :data:`TINY_LLAMA`)."""
    import torch
    from safetensors.torch import save_file

    c = config or TINY_LLAMA
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(c))
    h, inter, heads, kv, hd = (c["hidden_size"], c["intermediate_size"],
                               c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
        "lm_head.weight": (c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * hd, h),
            p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h),
            p + "self_attn.o_proj.weight": (h, heads * hd),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
            continue
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        scale = (2.0 if name.startswith(("model.embed", "lm_head")) else 1.0) / shape[1] ** 0.5
        tensors[name] = torch.randn(shape, generator=g) * scale
    save_file(tensors, str(directory / "model.safetensors"))
    return str(directory)


def side_config(aux_rows: int, dtype: str = KV_DTYPE) -> dict[str, Any]:
    """What the backend reads of one server's pools (sglang_mha: its pool and metadata
    rows, one transfer in flight per row), as a side YAML."""
    c = TINY_LLAMA
    spec = sglang_mha_spec(num_layers=c["num_hidden_layers"], page_size=PAGE_SIZE,
                           num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                           dtype=dtype, token_rows=MAX_TOTAL_TOKENS + PAGE_SIZE,
                           aux_item_lens=AUX_ITEM_LENS, aux_rows=aux_rows,
                           max_inflight=aux_rows)
    return config_to_mapping(SideConfig(model=MODEL_NAME, target=spec))


def described_pools(server: Process) -> list[dict[str, Any]]:
    """The pools' descriptions the server's kvbeam backend logged at start (one per
    manager), as side-YAML mappings."""
    marker = "kvbeam sglang backend ("
    out = []
    for line in server.text().splitlines():
        if marker in line and "): pools {" in line:
            out.append(json.loads(line[line.index("): pools ") + len("): pools "):]))
    return out


class Process:
    """A subprocess with its output in ``log``; stopped with its whole process group."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        self.started = time.monotonic()
        self.ready_s: float | None = None
        self._out = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env}, cwd=ROOT,
                                     start_new_session=True)

    def text(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float = START_S) -> None:
        """Block until ``needle`` appears in its output (it must not exit before)."""
        deadline = time.monotonic() + timeout
        while needle not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = "".join(self.text().splitlines(keepends=True)[-60:])
                raise AssertionError(f"{self.name}: no {needle!r} (exit {self.proc.poll()})"
                                     f"; {' '.join(self.cmd)}\n{tail}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - self.started

    def wait_listening(self, port: int, timeout: float = START_S) -> None:
        """Block until something accepts on ``127.0.0.1:port`` (it must not exit before)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: not listening on {port} (exit "
                                     f"{self.proc.poll()})\n{self.text()[-4000:]}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - self.started

    def stop(self) -> None:
        """SIGTERM the group, SIGKILL it after 30 s."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # sglang's children
        self._out.close()


def sglang_env(extra: dict[str, str] | None = None, path: tuple[Path, ...] = ()
               ) -> dict[str, str]:
    """The servers' environment: the CPU engine, the import stand-ins (and ``path``
    before them), one thread."""
    pythonpath = os.pathsep.join(str(p) for p in (*path, STUBS, ROOT))
    return {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1",
            **(extra or {})}


def sglang_server(name: str, model: str, port: int, log: Path, *flags: str,
                  env: dict[str, str] | None = None, path: tuple[Path, ...] = ()) -> Process:
    """``python -m sglang.launch_server`` with the test's flags plus ``flags``."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
           "--host", "127.0.0.1", "--port", str(port), *SGLANG_FLAGS, *flags]
    return Process(name, cmd, log, sglang_env(env, path))


def daemon(role: str, listen: str, sock: Path, log: Path, config: Path | None = None,
           name: str = "", extra: tuple[str, ...] = ()) -> Process:
    """``kvbeam ROLE --pools engine`` (TCP transport on loopback) and ``extra`` flags: the
    pools' description comes with the engine's attach; ``config``, when given, only
    checks it."""
    cmd = [sys.executable, "-m", "kvbeam.cli", role, "--listen", listen, "--pools", "engine",
           "--attach-socket", str(sock), "--transport", "tcp",
           *(("--config", str(config)) if config is not None else ()), *extra]
    return Process(name or f"kvbeam {role}", cmd, log, {})


def router(port: int, prefill: str, bootstrap_port: int, decode: str, log: Path) -> Process:
    """sglang's router in PD mode (its mini load balancer) over one pair."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--mini-lb", "--host", "127.0.0.1", "--port", str(port),
           "--prefill", prefill, str(bootstrap_port), "--decode", decode]
    return Process("router", cmd, log, {})


def generate(port: int, input_ids: list[int], max_new_tokens: int, timeout: float = 300.0
             ) -> dict[str, Any]:
    """POST /generate, greedy; sglang's JSON reply."""
    return post_generate(port, {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}, timeout)


def post_generate(port: int, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """POST ``body`` to /generate; sglang's JSON reply, or ``{"error": status, "detail":
    ...}`` for an HTTP error."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out: dict[str, Any] = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return {"error": exc.code, "detail": exc.read().decode(errors="replace")}
    return out
