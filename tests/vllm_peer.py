"""One vLLM instance for tests/host/test_vllm_connector.py, as a fresh process.

    python -m tests.vllm_peer MODE MODEL_DIR JOB.json OUT.json

MODE ``plain`` (no connector), ``prefill`` or ``decode`` (the kvbeam connector; JOB's
``connector`` is its ``kv_connector_extra_config``; ``connector_module`` and
``connector_class``, where given, load another connector class, such as the test's
negative control in tests/vllm_zeroing.py). JOB holds the prompts (token ids)
and ``max_tokens``. Once its engine is up the peer prints ``peer ready`` and reads
lines, each a JSON list of per-prompt ``kv_transfer_params`` (or ``null``): per line it
runs the batch, writes OUT (per prompt the token ids, finish reason, returned
kv_transfer_params and seconds) and prints ``peer done``. An empty line or EOF ends it
(prefill keeps its engine, and so its attached KV cache, until then).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def build(mode: str, model_dir: str, job: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
                                  dtype=job["dtype"], max_model_len=512, enforce_eager=True,
                                  seed=0, block_size=job["block_size"],
                                  enable_prefix_caching=mode == "plain")
    if mode != "plain":
        kwargs["kv_transfer_config"] = {  # JOB may name a test connector (tests.vllm_zeroing)
            "kv_connector": job.get("connector_class", "KvbeamConnector"),
            "kv_connector_module_path": job.get("connector_module", "kvbeam.integrations.vllm"),
            "kv_role": "kv_producer" if mode == "prefill" else "kv_consumer",
            "kv_connector_extra_config": job["connector"],
        }
    return LLM(**kwargs)


def reseed_weights(model: Any) -> None:
    """Seeded weights in place of vLLM's +-1e-3 dummy ones (with those the output ignores
    the context), identical in every instance: 1/sqrt(fan-in) normal, sharper attention.

    vLLM's CPU linear layers compute with a packed copy of their weight (some drop the
    weight itself), so each one is packed again from the new weight.
    """
    import zlib

    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for mname, module in sorted(model.named_modules()):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if "norm" in mname:
            weight.data.fill_(1.0)
            continue
        shape = tuple(weight.shape)
        if not weight.numel():  # dropped after packing: the layer's own sizes
            shape = (getattr(module, "output_size_per_partition", None)
                     or module.num_embeddings_per_partition,
                     getattr(module, "input_size_per_partition", None) or module.embedding_dim)
        g = torch.Generator().manual_seed(zlib.crc32(mname.encode()))
        w = torch.randn(shape, generator=g) / float(shape[-1]) ** 0.5
        if "qkv" in mname:
            w *= 2.0
        weight.data = w.to(weight.dtype)
        if hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def main() -> None:
    mode, model_dir, job_path, out_path = sys.argv[1:5]
    with open(job_path) as f:
        job = json.load(f)
    from vllm import SamplingParams

    llm = build(mode, model_dir, job)
    if job.get("reseed", True):
        # By its module name: a function of __main__ does not pickle to the worker.
        from tests.vllm_peer import reseed_weights as by_name

        llm.apply_model(by_name)
    print("peer ready", flush=True)
    while line := sys.stdin.readline().strip():
        params = json.loads(line) or [None] * len(job["prompts"])
        with open(out_path, "w") as f:
            json.dump(run(llm, SamplingParams, job, params), f)
        print("peer done", flush=True)


def run(llm: Any, sampling: Any, job: dict[str, Any], params: list[Any]) -> list[Any]:
    """One batch, all prompts in one generate call (decode reserves them all at once)."""
    sps = [sampling(max_tokens=job["max_tokens"], temperature=0, detokenize=False,
                    ignore_eos=True, extra_args={"kv_transfer_params": p} if p else None)
           for p in params]
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], sps, use_tqdm=False)
    seconds = time.monotonic() - t0
    return [{"tokens": list(o.outputs[0].token_ids), "finish": str(o.outputs[0].finish_reason),
             "kv_transfer_params": o.kv_transfer_params, "seconds": seconds} for o in outs]


if __name__ == "__main__":
    main()
