"""The runner's LoRA side: which adapter each running request uses, the device slot table, and
each step's per-token slot index (one more field of the packed host transfer).

The scheduler keeps the running requests' distinct adapters within ``max_loras``, so each
step's adapters get a slot (:class:`~jaxserve.core.lora_slots.LoRASlotAssigner`); an adapter new
to its slot is written before the step launches. The write is one jitted update with a traced
slot index: it compiles nothing after the first one, and a step already in flight keeps the
table it was launched with (arrays are immutable).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.core.lora_slots import LoRASlotAssigner
from jaxserve.models.config import ModelConfig
from jaxserve.models.lora_adapter import LoRAAdapter
from jaxserve.models.lora_slots import LoRASlotTable
from jaxserve.models.tp_layout import TPLayout
from jaxserve.runner.mesh import lora_table_specs


class RunnerLoRA:
    """``place(tree, shardings)``: the runner's placement (device arrays, or for an abstract target
    their shapes carrying the shardings)."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, mesh: Mesh, layout: TPLayout,
                 place: Callable, abstract: bool = False, lm_head: bool = False, embedding: bool = False):
        self.table = LoRASlotTable(cfg, max_loras, max_rank, layout=layout, abstract=abstract, lm_head=lm_head,
                                   embedding=embedding)
        a_specs, b_specs = lora_table_specs(self.table.a)
        self.shardings = ({k: NamedSharding(mesh, v) for k, v in a_specs.items()},
                          {k: NamedSharding(mesh, v) for k, v in b_specs.items()})
        self.table.a, self.table.b = place((self.table.a, self.table.b), self.shardings)
        self.slots = LoRASlotAssigner(max_loras)
        self.key_of: dict[str, str] = {}  # request id -> adapter key (name@sha256)
        self.adapters: dict[str, LoRAAdapter] = {}  # adapter key -> weights, while a request uses it
        self.num_slot_writes = 0

    @property
    def has_lm_head(self) -> bool:
        """The LM head has slots: the logits rows (and prompt logprobs) carry their slot."""
        return "lm_head" in self.table.a

    @property
    def tables(self) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        return self.table.a, self.table.b

    def add_request(self, req_id: str, key: str | None, adapter: object) -> None:
        if key is None:
            return
        if adapter is None:
            raise ValueError(f"request {req_id}: LoRA adapter {key} came without its weights")
        assert isinstance(adapter, LoRAAdapter)
        self.key_of[req_id] = key
        self.adapters[key] = adapter

    def remove_request(self, req_id: str) -> None:
        key = self.key_of.pop(req_id, None)
        if key is not None and key not in self.key_of.values():
            self.adapters.pop(key, None)  # its slot stays filled, reusable if it comes back soon

    def token_slots(self, req_ids: list[str], counts: list[int], num_tokens: int) -> np.ndarray:
        """Each token's slot (-1: the base model) for a step of ``req_ids`` scheduled for
        ``counts`` tokens, laid end to end and padded to ``num_tokens``; loads the adapters new to
        their slots first."""
        self.slots.begin_step()
        row_slot = np.full(len(req_ids), -1, np.int32)
        for i, r in enumerate(req_ids):
            key = self.key_of.get(r)
            if key is None:
                continue
            slot = self.slots.admit(key)
            if slot is None:  # the scheduler's max_loras bound makes this unreachable
                raise RuntimeError(f"LoRA: no free slot for {key} (more than max_loras adapters in one step)")
            row_slot[i] = slot
        for slot, key in self.slots.pending_writes:
            self.table.write(slot, self.adapters[key])
            self.num_slot_writes += 1
        self.slots.pending_writes.clear()
        out = np.full(num_tokens, -1, np.int32)
        total = int(sum(counts))
        out[:total] = np.repeat(row_slot, counts)
        return out
