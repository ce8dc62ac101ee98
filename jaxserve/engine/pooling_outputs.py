"""vLLM's pooling output types: ``EmbeddingRequestOutput``, ``ClassificationRequestOutput``,
``ScoringRequestOutput``, each a ``PoolingRequestOutput`` whose ``outputs`` holds one result."""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ScoringOutput:
    score: float


T = TypeVar("T")


@dataclasses.dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    pass


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    pass


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
