"""What a pooling request asks for (vLLM's ``PoolingParams``): its task, and BERT's segment ids."""

from __future__ import annotations

import dataclasses

POOLING_TASKS = ("embed", "classify")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """A request carrying these ends after its prefill with one pooled vector: no sampler, no decode.
    ``token_type_ids``: an encoder's segment of each prompt token (a cross-encoder's pair marks
    the second text with 1); None: all 0."""

    task: str = "embed"
    token_type_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task: must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
