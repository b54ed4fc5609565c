"""kvbeam for inference engines: put your pools in shareable memory and attach them.

An engine process allocates its KV pools in memfds (:class:`EnginePools`, in kvbeam's
layout; or moves tensors it allocated itself into shared memory with
:class:`SharedMemory`), then hands them to its local daemon (``--pools engine``) with
:func:`attach`; the daemon maps the same pages and serves transfers from and into
them until the engine detaches or exits (or, with ``reattach``, attaches the same memory
again to a restarted daemon: :class:`Reattach`). The per-request calls an engine scheduler
makes are :class:`Sender` (prefill), :class:`Receiver` (decode) and :class:`KVPoll`
(:mod:`kvbeam.engine.requests`). An engine whose KV is not host shared memory (a GPU's)
attaches a :class:`StagingBuffer` instead and copies through it
(:mod:`kvbeam.engine.staging`, docs/gpu.md). Importing this package imports neither
gRPC nor torch (torch only when a tensor view is asked for). docs/engine.md.
"""

from kvbeam.engine.attach import Attachment, Reattach, attach
from kvbeam.engine.memory import EngineBuffers, EnginePools, SharedMemory
from kvbeam.engine.requests import KVPoll, Receiver, Sender
from kvbeam.engine.staging import StagingBuffer
from kvbeam.engine.staging_slots import FullPolicy
from kvbeam.errors import AttachError, StagingFull
from kvbeam.proto.attach_codec import BufferRef

__all__ = ["AttachError", "Attachment", "BufferRef", "EngineBuffers", "EnginePools",
           "FullPolicy", "KVPoll", "Reattach", "Receiver", "Sender", "SharedMemory",
           "StagingBuffer", "StagingFull", "attach"]
