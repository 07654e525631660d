"""Adapters of one served model: the host cache, the device slots and each step's mapping.

- Loaded adapters (`add_lora`, or the first request naming one) stay in an LRU cache of
  `max_cpu_loras` entries; pinned ones are never evicted. A request whose adapter was evicted or
  removed loads it again from its path, as on vLLM's GPU runner.
- `max_loras` device slots hold the adapters a step uses (vLLM's scheduler never puts more
  distinct adapters in one step). An adapter not in a slot takes a free one, or the least
  recently used one no row of this step needs.
- Before each forward, `prepare` turns the rows' adapters into the token mask the wrapped
  projections read (`layer.py`).

The slots are allocated with the model and counted in its weights; the runner adds room for a
full host cache at `max_lora_rank`, so the KV cache is sized with adapters in mind.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from vllm_metal._logging import init_logger
from vllm_metal.backends.mlx.runner.lora.checkpoint import Adapter, AdapterError, read_adapter
from vllm_metal.backends.mlx.runner.lora.layer import LoRALinear, StepMask, projection_shape

if TYPE_CHECKING:
    from vllm.config.lora import LoRAConfig
    from vllm.lora.request import LoRARequest

logger = init_logger(__name__)


class LoRAManager:
    def __init__(
        self,
        lora_config: LoRAConfig,
        dtype: mx.Dtype,
        *,
        max_position_embeddings: int | None = None,
    ):
        self.config = lora_config
        self.dtype = dtype
        self.rank = lora_config.max_lora_rank
        self.num_slots = lora_config.max_loras
        self.max_position_embeddings = max_position_embeddings
        self.step = StepMask()
        self.layers: dict[str, LoRALinear] = {}
        self.cache: OrderedDict[int, Adapter] = OrderedDict()  # LRU first
        self.pinned: set[int] = set()
        self.slot_owner: list[int | None] = [None] * self.num_slots
        self.slot_used: list[int] = [0] * self.num_slots  # step counter when last used
        self.steps = 0

    # ------------------------------------------------------------ the model

    def wrap(self, model: Any) -> None:
        """Wrap the linear projections of `model`'s decoder layers (a freshly loaded model)."""
        targets = self.config.target_modules
        replacements = []
        for path, module in model.named_modules():
            shape = projection_shape(module)
            if shape is None or ".layers." not in f".{path}":
                continue
            if targets and path.split(".")[-1] not in targets:
                continue
            replacements.append((path, module, shape))
        if not replacements:
            raise ValueError("--enable-lora: the model has no linear projections to adapt")
        width = self.num_slots * self.rank
        self.layers = {
            path: LoRALinear(module, shape, width, self.dtype, self.step)
            for path, module, shape in replacements
        }
        model.update_modules(tree_unflatten(list(self.layers.items())))
        mx.eval([(layer.lora_a, layer.lora_b) for layer in self.layers.values()])
        # A new model starts with empty slots; adapters stay in the host cache.
        self.slot_owner = [None] * self.num_slots
        logger.info(
            "LoRA: %d projections wrapped, %d slot(s) of rank %d (%.1f MiB)",
            len(self.layers),
            self.num_slots,
            self.rank,
            self.slot_bytes / 2**20,
        )

    @property
    def shapes(self) -> dict[str, tuple[int, int]]:
        return {
            path: (layer.lora_a.shape[1], layer.lora_b.shape[1])
            for path, layer in self.layers.items()
        }

    @property
    def slot_bytes(self) -> int:
        return sum(layer.lora_a.nbytes + layer.lora_b.nbytes for layer in self.layers.values())

    @property
    def host_cache_bytes(self) -> int:
        """Room for a full host cache: `max_cpu_loras` adapters at `max_lora_rank` (float32)."""
        per_adapter = sum(self.rank * (i + o) * 4 for i, o in self.shapes.values())
        return self.config.max_cpu_loras * per_adapter

    # ------------------------------------------------------------ vLLM's adapter calls

    def add(self, request: LoRARequest) -> bool:
        if request.lora_int_id in self.cache:
            self.cache.move_to_end(request.lora_int_id)
            if not request.load_inplace:
                return False
            self._drop(request.lora_int_id)
        self._load(request)
        return True

    def remove(self, lora_id: int) -> bool:
        self.pinned.discard(lora_id)
        if lora_id not in self.cache:
            return False
        self._drop(lora_id)
        return True

    def pin(self, lora_id: int) -> bool:
        if lora_id not in self.cache:
            raise ValueError(f"LoRA adapter {lora_id} is not loaded; it cannot be pinned")
        self.pinned.add(lora_id)
        return True

    def list(self) -> set[int]:
        return set(self.cache)

    # ------------------------------------------------------------ the step

    def prepare(
        self, row_lora_ids: np.ndarray, requests: dict[int, LoRARequest], tokens_per_row: np.ndarray
    ) -> None:
        """Set the mask of the next forward: row i (lora id, 0 for none) has tokens_per_row[i]."""
        self.steps += 1
        needed = sorted({int(i) for i in row_lora_ids} - {0})
        step = self.step
        step.clear()
        if not needed:
            return
        slot_of = self._activate(needed, requests)
        row_slots = np.array([slot_of.get(int(i), -1) for i in row_lora_ids], dtype=np.int32)
        if len(needed) == 1 and (row_slots >= 0).all():  # one adapter, no base-model row
            step.rows = self._block(slot_of[needed[0]])
            return
        token_slots = np.repeat(row_slots, tokens_per_row)
        # Only the blocks up to the highest slot in use take part (slots fill from the lowest).
        width = (max(slot_of.values()) + 1) * self.rank
        block = np.arange(width, dtype=np.int32) // self.rank
        mask = (block[None, :] == token_slots[:, None]).astype(np.float32)
        step.rows = slice(0, width)
        step.mask = mx.array(mask, dtype=self.dtype)[:, None, :]

    def clear_step(self) -> None:
        self.step.clear()

    def _activate(self, needed: list[int], requests: dict[int, LoRARequest]) -> dict[int, int]:
        if len(needed) > self.num_slots:
            raise RuntimeError(
                f"{len(needed)} adapters in one step but --max-loras is {self.num_slots}"
            )
        slot_of = {owner: s for s, owner in enumerate(self.slot_owner) if owner in needed}
        for lora_id in needed:
            if lora_id in self.cache:
                self.cache.move_to_end(lora_id)
            else:
                self._load(requests[lora_id], keep=needed)
            if lora_id not in slot_of:
                slot = self._free_slot(slot_of)
                self._fill(slot, self.cache[lora_id])
                slot_of[lora_id] = slot
        for slot in slot_of.values():
            self.slot_used[slot] = self.steps
        return slot_of

    def _free_slot(self, taken: dict[int, int]) -> int:
        busy = set(taken.values())
        free = [s for s, owner in enumerate(self.slot_owner) if owner is None and s not in busy]
        if free:
            return free[0]
        return min(
            (s for s in range(self.num_slots) if s not in busy), key=self.slot_used.__getitem__
        )

    def _block(self, slot: int) -> slice:
        """The rank-block rows of `slot` in every wrapped projection."""
        return slice(slot * self.rank, (slot + 1) * self.rank)

    def _fill(self, slot: int, adapter: Adapter) -> None:
        rows = self._block(slot)
        for path, layer in self.layers.items():
            delta = adapter.deltas.get(path)
            if delta is None:
                layer.clear(rows)
            else:
                layer.write(rows, mx.array(delta.a), mx.array(delta.b))
        mx.eval([(layer.lora_a, layer.lora_b) for layer in self.layers.values()])
        self.slot_owner[slot] = adapter.lora_id

    # ------------------------------------------------------------ the host cache

    def _load(self, request: LoRARequest, keep: list[int] = ()) -> None:
        adapter = read_adapter(
            request,
            self.config,
            self.shapes,
            max_position_embeddings=self.max_position_embeddings,
        )
        while len(self.cache) >= self.config.max_cpu_loras:
            victim = next((i for i in self.cache if i not in self.pinned and i not in keep), None)
            if victim is None:
                raise AdapterError(
                    f"LoRA adapter {request.lora_name!r}: all {len(self.cache)} cached adapters "
                    "are pinned or in use; raise --max-cpu-loras"
                )
            self._drop(victim)
        self.cache[adapter.lora_id] = adapter
        logger.info(
            "LoRA adapter %r (id %d) loaded from %s: %d modules, %.1f MiB",
            adapter.name,
            adapter.lora_id,
            adapter.path,
            len(adapter.deltas),
            adapter.nbytes / 2**20,
        )

    def _drop(self, lora_id: int) -> None:
        self.cache.pop(lora_id, None)
        for slot, owner in enumerate(self.slot_owner):
            if owner == lora_id:
                for layer in self.layers.values():
                    layer.clear(self._block(slot))
                self.slot_owner[slot] = None
