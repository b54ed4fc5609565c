"""The vLLM worker's staging decision and what it reports of its staging buffer.

vLLM's KV cache on a GPU cannot be mapped by the daemon: the worker then attaches a
host staging buffer instead (:class:`~kvbeam.engine.staging.StagingBuffer`) and copies
each request through it (:mod:`kvbeam.integrations.vllm.worker`). :func:`stages`
decides from where the cache lives, the connector's ``staging`` setting and vLLM's own
``kv_buffer_device`` (``--kv-transfer-config``; NixlConnector's host buffer is
``"cpu"``). :class:`StagingReport` turns the buffer's cumulative metrics into the
per-step numbers vLLM's connector stats carry (its "KV Transfer metrics" log line and
``vllm:kvbeam_staging_*`` in its /metrics). No vLLM import.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvbeam.engine.staging import StagingMetrics
from kvbeam.errors import ConfigError
from kvbeam.integrations.vllm.params import Staging

log = logging.getLogger(__name__)

#: The connector stats key of a staging buffer's occupancy gauge (the fullest kind's
#: share held, in percent); the other keys are per-step counters (:meth:`StagingReport.take`).
STAGING_OCCUPANCY = "staging_occupancy_pct"


def stages(kv_device: str, setting: Staging, kv_buffer_device: str) -> bool:
    """Whether the worker stages a KV cache that lives on ``kv_device`` (``cpu``,
    ``cuda``...).

    A cache off the CPU is always staged (the daemon maps host memory only; kvbeam's
    GPUDirect kind is not wired to vLLM). vLLM's ``kv_buffer_device`` names where the
    transfer buffer lives: ``"cpu"`` (a host buffer, NixlConnector's setting) or the
    cache's own device (vLLM's default); with a GPU cache both stage through a pinned
    host buffer, the second said in the log. On the CPU, ``staging: true`` stages the
    cache's ordinary tensors instead of moving them into shared memory.

    Raises:
        ConfigError: ``staging: false`` with a GPU cache, or a ``kv_buffer_device`` that
            is neither ``cpu`` nor the cache's device.
    """
    device = kv_device.partition(":")[0]
    buffer = (kv_buffer_device or device).partition(":")[0]
    if buffer not in ("cpu", device):
        raise ConfigError(f"--kv-transfer-config kv_buffer_device {kv_buffer_device!r}: "
                          f"vLLM's KV cache is on {kv_device}; kvbeam stages it through a "
                          f"host buffer (\"cpu\") or reads it where it is (\"{device}\")")
    if device == "cpu":
        return bool(setting.enabled)
    if setting.enabled is False:
        raise ConfigError(f"kv_connector_extra_config.staging: false, but vLLM's KV cache "
                          f"is on {kv_device}: a kvbeam daemon maps host memory only, so a "
                          "GPU cache moves through a pinned host buffer; leave staging out")
    if buffer != "cpu":
        log.info("kv_buffer_device %r: kvbeam moves vLLM's %s KV cache through a pinned "
                 "host staging buffer (the daemons move host memory; kv_buffer_device "
                 "\"cpu\" says so)", kv_buffer_device or device, kv_device)
    return True


@dataclass
class StagingReport:
    """What a staging buffer did since the last :meth:`take` (vLLM's connector stats)."""

    last: StagingMetrics | None = None
    last_occupancy: float = -1.0

    def take(self, now: StagingMetrics) -> dict[str, float]:
        """The counters' growth since the last call and the occupancy when it changed
        (percent); nothing when nothing changed."""
        before = self.last or StagingMetrics()
        values = {"staging_bytes_out": now.bytes_out - before.bytes_out,
                  "staging_bytes_in": now.bytes_in - before.bytes_in,
                  "staging_copy_out_s": now.copy_out_s - before.copy_out_s,
                  "staging_copy_in_s": now.copy_in_s - before.copy_in_s,
                  "staging_waits": now.waits - before.waits,
                  "staging_refusals": now.refusals - before.refusals}
        out: dict[str, float] = {k: v for k, v in values.items() if v}
        if now.occupancy != self.last_occupancy:
            out[STAGING_OCCUPANCY] = round(100.0 * now.occupancy, 1)
            self.last_occupancy = now.occupancy
        self.last = now
        return out
