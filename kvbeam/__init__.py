"""kvbeam: KV-state transport for prefill/decode disaggregated LLM serving.

Subpackages (each a top-level folder of the repository, mapped into the package by
pyproject.toml's package-dir: one name per module, no symlinks):

- ``kvbeam.pools``: DeepSeek-V4 pool specs, layouts, torch allocation, index maps,
  transfer plans and the target/draft compatibility checks. The only package that
  imports torch, and only in :mod:`kvbeam.pools.allocate`.
- ``kvbeam.proto``: the ``kvbeam.v1`` protobuf/gRPC protocol.
- ``kvbeam.transport``: moves (address, length, key) regions; RDMA through pyverbs,
  TCP where no RDMA device exists. Never imports torch.
- ``kvbeam.server``: the prefill and decode daemons.

Shared by the daemons and their clients (none imports ``kvbeam.server``):
:mod:`kvbeam.errors` (every error class; docs/errors.md), :mod:`kvbeam.rpc_errors`
(errors <-> gRPC status codes), :mod:`kvbeam.states` (transfer states and statuses),
:mod:`kvbeam.auth` (mTLS and token credentials), :mod:`kvbeam.logs` (log fields and
formats), :mod:`kvbeam.control_channel` (the channel every control client is); the
public client :mod:`kvbeam.client` and :mod:`kvbeam.scheduler`.
"""

from kvbeam.errors import KvbeamError

__all__ = ["KvbeamError", "__version__"]
__version__ = "0.1.0"
