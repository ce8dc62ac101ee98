"""The offline side of a pooling model: ``LLM.embed``, ``LLM.classify`` and ``LLM.score``.

Prompts are tokenized here and run by :class:`~jaxserve.runner.pooling_runner.PoolingRunner`;
``score`` pairs a query with each document: a classifier reads the pair as one prompt (a
cross-encoder; BERT marks the second text with token type 1), an embedder scores by cosine.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxserve.exceptions import InvalidRequestError
from jaxserve.models.pooling_config import resolve_pooler_config, resolve_pooling_task

Prompt = Union[str, list[int]]


def pooling_task_of(config: EngineConfig) -> str | None:
    """The pooling task a configuration serves, or None (it generates; also for a hub id not on disk)."""
    if config.model is None or not os.path.isfile(os.path.join(config.model, "config.json")):
        if config.runner == "pooling" or config.convert in ("embed", "classify"):
            raise InvalidRequestError("model", "a pooling model must be a local checkpoint folder for now")
        return None
    archs = json.loads((Path(config.model) / "config.json").read_text()).get("architectures")
    return resolve_pooling_task(archs, config.model, config.runner, config.convert)


class PoolingLLM:
    def __init__(self, config: EngineConfig, task: str, tokenizer: Any = None):
        from jaxserve.engine.llm_engine import load_tokenizer
        from jaxserve.runner.pooling_runner import PoolingRunner

        assert config.model is not None
        self.task = task
        self.pooler = resolve_pooler_config(task, config.model, config.pooler_config)
        self.runner = PoolingRunner(config.model, task, self.pooler, config.max_model_len)
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer or config.model)
        self._counter = itertools.count()

    def _ids(self, prompt: Prompt, truncate: int | None) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        return ids[-truncate:] if truncate else ids  # vLLM keeps the last tokens

    def _need(self, task: str) -> None:
        if self.task != task:
            raise InvalidRequestError("task", f"this model serves {self.task!r}, not {task!r}")

    def embed(self, prompts: Sequence[Prompt], truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        self._need("embed")
        ids = [self._ids(p, truncate_prompt_tokens) for p in prompts]
        rows = self.runner.run(ids)
        if dimensions is not None:
            if not 0 < dimensions <= rows.shape[1]:
                raise InvalidRequestError("dimensions", f"must be in 1..{rows.shape[1]}, got {dimensions}")
            rows = rows[:, :dimensions]  # Matryoshka: a prefix, renormalized when the pooler normalizes
            if self.pooler.normalize:
                rows = rows / np.maximum(np.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)
        return [EmbeddingRequestOutput(str(next(self._counter)), EmbeddingOutput(r.tolist()), i)
                for r, i in zip(rows, ids)]

    def classify(self, prompts: Sequence[Prompt], truncate_prompt_tokens: int | None = None
                 ) -> list[ClassificationRequestOutput]:
        self._need("classify")
        ids = [self._ids(p, truncate_prompt_tokens) for p in prompts]
        rows = self.runner.run(ids)
        return [ClassificationRequestOutput(str(next(self._counter)), ClassificationOutput(r.tolist()), i)
                for r, i in zip(rows, ids)]

    def score(self, query: str, documents: Sequence[str], truncate_prompt_tokens: int | None = None
              ) -> list[ScoringRequestOutput]:
        if not documents:
            raise InvalidRequestError("documents", "must not be empty")
        if self.task == "embed":
            vecs = np.asarray([o.outputs.embedding for o in self.embed([query, *documents], truncate_prompt_tokens)])
            vecs = vecs / np.maximum(np.linalg.norm(vecs, axis=-1, keepdims=True), 1e-12)
            scores = (vecs[1:] @ vecs[0]).tolist()
            ids = [self._ids(d, truncate_prompt_tokens) for d in documents]
        else:
            pairs = [self.tokenizer(query, d) for d in documents]
            cut = slice(-truncate_prompt_tokens if truncate_prompt_tokens else 0, None)
            ids = [p["input_ids"][cut] for p in pairs]
            types = [(p.get("token_type_ids") or [0] * len(p["input_ids"]))[cut] for p in pairs]
            rows = self.runner.run(ids, types if self.runner.is_encoder else None)
            # One label: its probability; several: the last label's (the "relevant" class, as vLLM).
            scores = [float(r[-1]) for r in rows]
        return [ScoringRequestOutput(str(next(self._counter)), ScoringOutput(s), i) for s, i in zip(scores, ids)]
