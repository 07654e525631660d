"""vLLM's KV-connector lifecycle around an MLX step (KV offloading, `vllm_metal.kv.offload`).

Per step, in the order vLLM's own runners keep: flush the stores of preempted requests, bind the
scheduler's connector metadata, start the step's transfers, run the forward, queue the step's
stores, then collect finished transfers into the step's `KVConnectorOutput`. Transfers start
before the forward is queued here (vLLM's GPU runner starts asynchronous loads after it): a
store's gather then reads the pool as the previous step left it, without waiting for this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_metal.kv.offload.transfer import MLXTransfer
    from vllm_metal.kv.pool import KVPool


class ConnectorSteps:
    def __init__(self):
        self.connector = get_kv_transfer_group()
        self.transfer: MLXTransfer | None = None

    @staticmethod
    def make() -> ConnectorSteps | None:
        return ConnectorSteps() if has_kv_transfer_group() else None

    def bind_pool(self, pool: KVPool, kv_cache_config: KVCacheConfig) -> None:
        """Give the offloading connector's worker a transfer worker on this pool."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            get_offloading_group_ids,
        )

        from vllm_metal.kv.offload.spec import MetalOffloadingSpec

        worker = getattr(self.connector, "connector_worker", None)
        spec = getattr(worker, "spec", None)
        if not isinstance(spec, MetalOffloadingSpec):
            raise TypeError(
                f"vllm-metal: KV connector {type(self.connector).__name__} is not supported; "
                "use --kv-offloading-size (vLLM's OffloadingConnector)"
            )
        self.transfer = spec.bind_pool(pool, list(get_offloading_group_ids(kv_cache_config)))
        worker.worker = self.transfer

    def release_pool(self) -> None:
        """The pool is being freed (sleep mode): the transfer worker lets go of it too."""
        if self.transfer is not None:
            self.transfer.pool = None

    def start(self, scheduler_output: SchedulerOutput) -> None:
        meta = scheduler_output.kv_connector_metadata
        assert meta is not None, "a KV connector runs but the step carries no metadata"
        self.connector.handle_preemptions(meta)
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)

    def finish(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        connector = self.connector
        connector.wait_for_save()
        results = connector.get_transfer_results(scheduler_output.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        if self.transfer is not None:
            invalid |= self.transfer.take_load_errors()
        output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=connector.get_kv_connector_stats(),
            kv_cache_events=connector.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        return output
