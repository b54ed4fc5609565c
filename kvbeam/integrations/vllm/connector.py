"""``KvbeamConnector``: kvbeam as a vLLM v1 KV connector (``KVConnectorBase_V1``).

vLLM builds it once in the scheduler process (role SCHEDULER) and once per worker
(role WORKER), loading it with ``kv_connector_module_path`` (docs/vllm.md). Each role
delegates to :class:`~kvbeam.integrations.vllm.scheduler.SchedulerSide` or
:class:`~kvbeam.integrations.vllm.worker.WorkerSide`. kvbeam's daemons move requests
between the attached caches: whole, once a prompt ended, or, with ``layerwise``, each
layer of a finishing prompt as ``save_kv_layer`` says it is computed (a staged cache's
copies run at the step's start and end: ``start_load_kv``, ``get_finished``). Its
stats are vLLM's "KV Transfer metrics" log line and, in vLLM's
/metrics, ``vllm:kvbeam_events_total{event}`` and, staged,
``vllm:kvbeam_staging_bytes_total{direction}``,
``vllm:kvbeam_staging_copy_seconds_total{direction}`` and
``vllm:kvbeam_staging_occupancy`` (docs/vllm.md).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvbeam.errors import KvbeamError
from kvbeam.integrations.vllm.params import Settings
from kvbeam.integrations.vllm.scheduler import SchedulerSide, StepPlan, WorkerReport
from kvbeam.integrations.vllm.staged import STAGING_OCCUPANCY
from kvbeam.integrations.vllm.worker import WorkerSide

log = logging.getLogger(__name__)

#: The connector's counter in vLLM's /metrics (``vllm:kvbeam_events_total{event}``).
EVENTS_METRIC = "vllm:kvbeam_events"
#: A staged cache's counters and gauge in vLLM's /metrics (``..._total{direction}``).
STAGING_BYTES_METRIC = "vllm:kvbeam_staging_bytes"
STAGING_COPY_METRIC = "vllm:kvbeam_staging_copy_seconds"
STAGING_OCCUPANCY_METRIC = "vllm:kvbeam_staging_occupancy"
#: Stats keys that are a staging buffer's bytes and copy seconds: key -> (metric, direction).
_STAGING_AMOUNTS = {"staging_bytes_out": ("bytes", "out"), "staging_bytes_in": ("bytes", "in"),
                    "staging_copy_out_s": ("copy", "out"), "staging_copy_in_s": ("copy", "in")}


def use_vllm_log_format() -> None:
    """kvbeam's log lines in vLLM's processes through vLLM's own handlers (its format:
    level, timestamp, file), not Python's bare last-resort output. Done once, and only
    when nobody configured the ``kvbeam`` logger (a user's configuration wins)."""
    ours, theirs = logging.getLogger("kvbeam"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # as vLLM's own logger: no second copy through the root


class KvbeamWorkerMeta(KVConnectorWorkerMetadata):
    """The workers' :class:`WorkerReport` to the scheduler side (vLLM aggregates every
    worker's and hands it to :meth:`KvbeamConnector.update_connector_output`)."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvbeamWorkerMeta):
            return KvbeamWorkerMeta(self.report.merged(other.report))
        return self


class KvbeamStats(KVConnectorStats):
    """The connector's numbers since the last collection (``data``: name -> number):
    counts of requests that asked for a transfer and move nothing, failed sends and
    loads by reason, decode servers missing from ``decode_daemons``, requests sent layer
    by layer (``streamed``); staged, the
    staging buffers' bytes, copy seconds, waits and refusals (summed over the workers)
    and their occupancy in percent (the fullest worker's)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, n in other.data.items():
            if key == STAGING_OCCUPANCY:
                self.data[key] = max(self.data.get(key, 0.0), float(n))
            else:
                self.data[key] = self.data.get(key, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kvbeam {key}": (round(n, 4) if isinstance(n, float) else int(n))
                for key, n in sorted(self.data.items())}

    def is_empty(self) -> bool:
        # An occupancy back at 0 is news (the gauge must come down).
        return not any(self.data.values()) and STAGING_OCCUPANCY not in self.data


class KvbeamPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvbeam_events_total{event}`` in vLLM's /metrics, and a staged cache's
    ``vllm:kvbeam_staging_bytes_total{direction}``,
    ``vllm:kvbeam_staging_copy_seconds_total{direction}`` (``out``: prefill's gathers,
    ``in``: decode's scatters) and ``vllm:kvbeam_staging_occupancy`` (docs/vllm.md)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.events = self._counter_cls(
            name=EVENTS_METRIC, labelnames=[*labelnames, "event"],
            documentation="kvbeam connector events: requests that asked for a KV transfer "
                          "and move none (no_transfer_*, declined), failed sends and loads "
                          "by reason, decode servers missing from decode_daemons, requests "
                          "sent layer by layer (streamed), staging waits and refusals")
        direction = [*labelnames, "direction"]
        self.staging = {
            "bytes": self._counter_cls(
                name=STAGING_BYTES_METRIC, labelnames=direction,
                documentation="bytes kvbeam copied through its host staging buffer (out: "
                              "prefill's gathers from the KV cache, in: decode's scatters)"),
            "copy": self._counter_cls(
                name=STAGING_COPY_METRIC, labelnames=direction,
                documentation="seconds kvbeam's staging copies took (device time on CUDA)")}
        self.occupancy = self._gauge_cls(
            name=STAGING_OCCUPANCY_METRIC, labelnames=labelnames,
            documentation="the share of kvbeam's host staging buffer held by requests "
                          "(0..1, the fullest worker's)", multiprocess_mode="mostrecent")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues.get(engine_idx, [])
        for key, n in transfer_stats_data.items():
            if key == STAGING_OCCUPANCY:
                self.occupancy.labels(*labels).set(float(n) / 100.0)
            elif key in _STAGING_AMOUNTS:
                metric, way = _STAGING_AMOUNTS[key]
                if n:
                    self.staging[metric].labels(*labels, way).inc(n)
            elif n:
                self.events.labels(*labels, key).inc(n)


class KvbeamMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KvbeamConnector(KVConnectorBase_V1):
    """Prefill pushes a finished prompt's blocks into decode's reserved blocks."""

    #: The worker side the connector builds (a test's connector names its own).
    worker_class: type[WorkerSide] = WorkerSide

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        use_vllm_log_format()
        model = vllm_config.model_config
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        settings = Settings.from_extra(extra, str(model.served_model_name))
        block_size = int(vllm_config.cache_config.block_size)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._absorbed: object | None = None
        parallel = vllm_config.parallel_config
        tp_size = int(parallel.tensor_parallel_size)
        settings.check_tp(tp_size)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(settings, block_size)
        else:
            total = int(model.get_total_num_kv_heads())
            if total % tp_size:
                raise KvbeamError(
                    f"{total} KV heads over tensor_parallel_size {tp_size}: vLLM replicates "
                    "heads across ranks then, which kvbeam does not pair (each rank must "
                    "hold its own share of the heads)")
            transfer = vllm_config.kv_transfer_config
            self.worker = self.worker_class(
                settings, block_size, model.get_num_kv_heads(parallel), model.get_head_size(),
                tp_rank=_tp_rank(tp_size), tp_size=tp_size,
                kv_buffer_device=str(getattr(transfer, "kv_buffer_device", "") or ""),
                max_model_len=int(getattr(model, "max_model_len", 0) or 0),
                load_failure_policy=str(getattr(transfer, "kv_load_failure_policy", "fail")))

    # ---- scheduler side ----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        self.scheduler.plan_streams(scheduler_output)
        return KvbeamMetadata(self.scheduler.take_plan())

    def request_finished(self, request: Any, block_ids: Any
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self.scheduler is not None
        self.scheduler.sends_finished(connector_output.finished_sending)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvbeamWorkerMeta):
            self.scheduler.worker_report(meta.report)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.scheduler if self.scheduler is not None else self.worker
        counts = side.take_counts() if side is not None else {}
        return KvbeamStats(data=counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvbeamStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvbeamPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    # ---- worker side -------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def _absorb(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if meta is not self._absorbed and isinstance(meta, KvbeamMetadata):
            self._absorbed = meta
            self.worker.absorb(meta.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._absorb()  # the daemon writes the blocks; nothing to start here

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        # The layer's KV is in the cache (vLLM calls this after the layer's attention):
        # the step's streamed prompts make that layer ready, one frame each (no wait).
        if self.worker is not None:
            self._absorb()  # the step's plan, once: its streams start at the first layer
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.forward_done()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        self._absorb()
        assert self.worker is not None
        sent, received = self.worker.get_finished()
        return sent or None, received or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        report = self.worker.report() if self.worker is not None else None
        return KvbeamWorkerMeta(report) if report is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _tp_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank (vLLM's, set up before the connector's worker)."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())
