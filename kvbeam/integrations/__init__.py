"""Adapters that let inference engines use kvbeam through their own transfer interfaces.

Each subpackage imports its engine lazily and only when used, so ``import kvbeam`` never
pulls an engine in: ``kvbeam.integrations.vllm`` (vLLM's KV connector) and
``kvbeam.integrations.sglang`` (sglang's disaggregation transfer backend).
"""
