"""The offline side of a pooling model: ``LLM.embed``, ``LLM.classify`` and ``LLM.score``.

Prompts are tokenized here and run as pooling requests through an :class:`EngineCore` (the
scheduler every generation request goes through; see :mod:`.pooling_core`); ``score`` pairs a
query with each document: a classifier reads the pair as one prompt (a cross-encoder; BERT marks
the second text with token type 1), an embedder scores by cosine.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
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
    def __init__(self, config: EngineConfig, task: str, tokenizer: Any = None, show_progress: bool = False):
        from jaxserve.engine.engine_core import EngineCore
        from jaxserve.engine.llm_engine import load_tokenizer

        assert config.model is not None
        self.task = task
        self.pooler = resolve_pooler_config(task, config.model, config.pooler_config)
        self.core = EngineCore(config, show_progress=show_progress)
        if self.core.pooling_task != task:
            raise InvalidRequestError("task", f"this model serves {self.core.pooling_task!r}, not {task!r}")
        self.runner = self.core.runner
        self.max_model_len = self.core.max_model_len
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer or config.model)
        self._counter = itertools.count()
        self._lock = threading.Lock()  # one caller's batch at a time steps the core

    def _ids(self, prompt: Prompt, truncate: int | None) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        return ids[-truncate:] if truncate else ids  # vLLM keeps the last tokens

    def _need(self, task: str) -> None:
        if self.task != task:
            raise InvalidRequestError("task", f"this model serves {self.task!r}, not {task!r}")

    def run(self, prompts: Sequence[list[int]], token_type_ids: Sequence[list[int]] | None = None) -> np.ndarray:
        """``[N, D]`` float32: one row per prompt, in order, each a pooling request through the scheduler."""
        for i, p in enumerate(prompts):
            if not p:
                raise InvalidRequestError(f"input[{i}]", "empty prompt")
            if len(p) > self.max_model_len:
                raise InvalidRequestError(f"input[{i}]", f"{len(p)} tokens, more than max_model_len "
                                          f"{self.max_model_len}; pass truncate_prompt_tokens",
                                          code="context_length_exceeded")
        with self._lock:
            ids = [f"pool-{next(self._counter)}" for _ in prompts]
            for i, (req_id, p) in enumerate(zip(ids, prompts)):
                types = None if token_type_ids is None else tuple(token_type_ids[i])
                self.core.add_request(Request(req_id, list(p), SamplingParams(max_tokens=1), None,
                                              pooling_params=PoolingParams(self.task, types)))
            rows: dict[str, np.ndarray] = {}
            try:
                while len(rows) < len(ids):
                    for out in self.core.step():
                        if out.pooling_output is not None:
                            rows[out.request_id] = out.pooling_output
                        elif out.finished:
                            raise RuntimeError(f"pooling request {out.request_id} ended without a vector "
                                               f"({out.finish_reason})")
            except BaseException:
                self.core.abort_requests([r for r in ids if r not in rows])
                raise
        return np.stack([rows[r] for r in ids])

    def embed(self, prompts: Sequence[Prompt], truncate_prompt_tokens: int | None = None,
              dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        self._need("embed")
        ids = [self._ids(p, truncate_prompt_tokens) for p in prompts]
        rows = self.run(ids)
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
        rows = self.run(ids)
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
            rows = self.run(ids, types if self.runner.is_encoder else None)
            # One label: its probability; several: the last label's (the "relevant" class, as vLLM).
            scores = [float(r[-1]) for r in rows]
        return [ScoringRequestOutput(str(next(self._counter)), ScoringOutput(s), i) for s, i in zip(scores, ids)]
