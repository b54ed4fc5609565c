"""kvbeam as a vLLM KV connector (docs/vllm.md).

vLLM loads :class:`KvbeamConnector` with ``"kv_connector": "KvbeamConnector"`` and
``"kv_connector_module_path": "kvbeam.integrations.vllm"``. vLLM is imported only when
the connector class is looked up (module ``__getattr__``), so the request parameters
(:mod:`~kvbeam.integrations.vllm.params`) and the scheduler logic import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvbeamConnector", "KvbeamMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvbeam.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
