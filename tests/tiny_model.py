"""Write a tiny Llama checkpoint to try kvbeam with, offline: ``python tests/tiny_model.py DIR``.

DIR gets ``config.json`` (2 layers, hidden 128, 4 heads, 2 KV heads of 32, vocabulary
1024, float32) and ``model.safetensors`` (seeded 1/sqrt(fan-in) weights, about 2 MB),
which ``vllm serve`` (``--model DIR``) and sglang (``--model-path DIR``) load as any
model. It has no tokenizer: start the servers with ``--skip-tokenizer-init`` and send
token ids (``"prompt": [1, 2, 3]`` to vLLM, ``"input_ids"`` to sglang). The output is
not language, but it depends on the whole prompt, so a KV cache that did not arrive
intact changes it.

Needs numpy and safetensors only (both engines' venvs have them; kvbeam is not
imported), so it runs from any of them. The docs' commands run it (docs/vllm.md,
docs/sglang.md; tests/host/test_docs_run.py runs those commands).
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint and its shape (Llama's names)."""
    c = CONFIG
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv_heads, head = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    assert isinstance(hidden, int) and isinstance(inter, int) and isinstance(vocab, int)
    assert isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(head, int)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                       "lm_head.weight": (vocab, hidden),
                                       "model.norm.weight": (hidden,)}
    layers = c["num_hidden_layers"]
    assert isinstance(layers, int)
    for layer in range(layers):
        p = f"model.layers.{layer}."
        out |= {p + "self_attn.q_proj.weight": (heads * head, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,)}
    return out


def write(directory: Path) -> Path:
    """Write the checkpoint into ``directory`` (created); returns it."""
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {}
    for name, shape in shapes().items():
        if len(shape) == 1:  # norms
            tensors[name] = np.ones(shape, np.float32)
            continue
        rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same on every run
        w = rng.standard_normal(shape).astype(np.float32) / np.float32(shape[-1] ** 0.5)
        if any(k in name for k in ("q_proj", "k_proj", "v_proj")):
            w *= 2.0  # sharper attention: the context shows in the tokens
        tensors[name] = w
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=1))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def main() -> None:
    """``python tests/tiny_model.py DIR``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path, help="where to write config.json and "
                    "model.safetensors (created)")
    print(f"tiny Llama written to {write(ap.parse_args().directory)}")


if __name__ == "__main__":
    main()
