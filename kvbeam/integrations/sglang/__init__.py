"""kvbeam as an sglang disaggregation transfer backend (sglang 0.5.23; docs/sglang.md).

- :mod:`~kvbeam.integrations.sglang.conn`: ``KvbeamKVManager``, ``KvbeamKVSender``,
  ``KvbeamKVReceiver``, ``KvbeamKVBootstrapServer``, subclasses of sglang's base classes
  (importing it imports sglang, and says how to install it when missing);
- :mod:`~kvbeam.integrations.sglang.select`: ``install()`` makes
  ``--disaggregation-transfer-backend kvbeam`` resolve to them;
- :mod:`~kvbeam.integrations.sglang.plugin`: sglang's plugin entry point (pyproject.toml),
  which runs it in every sglang process, with
  :mod:`~kvbeam.integrations.sglang.memory` (sglang's KV pool and metadata rows in
  sealed memfds, and the pool objects remembered);
- :mod:`~kvbeam.integrations.sglang.describe`: the pools' description read from those
  pool objects (what the daemons compare), a side YAML checked against it, and the
  comparison of two servers' descriptions naming sglang's settings;
- :mod:`~kvbeam.integrations.sglang.scheduler`: the members sglang's schedulers read
  beyond the base classes, the metadata row's index list, prefill's poll states;
- :mod:`~kvbeam.integrations.sglang.kvargs` and
  :mod:`~kvbeam.integrations.sglang.bootstrap`: ``KVArgs`` to attach descriptions and
  index lists, and the rendezvous store (no sglang import).

Importing this package imports neither sglang nor gRPC.
"""
