"""Pooling models: embeddings, classification, score and rerank (vLLM's --runner/--convert/--pooler-config)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig


@dataclasses.dataclass
class PoolingConfig(SubConfig):
    runner: str = "auto"
    """vLLM's --runner: auto (pooling for *Model, *ForSequenceClassification and Sentence-Transformers
    folders, else generate), generate or pooling."""
    convert: str = "auto"
    """vLLM's --convert: embed or classify turn a causal LM into a pooling model; auto/none keep it."""
    pooler_config: str | None = None
    """JSON overriding the checkpoint's pooling, e.g. {"pooling_type": "MEAN", "normalize": true,
    "dimensions": 256}; default: the Sentence-Transformers files, else last token."""

    def validate(self) -> None:
        from jaxserve.models.pooling_config import CONVERTS, RUNNERS, parse_pooler_config

        if self.runner not in RUNNERS:
            raise self.bad("runner", f"must be one of {', '.join(RUNNERS)}")
        if self.convert not in CONVERTS:
            raise self.bad("convert", f"must be one of {', '.join(CONVERTS)}")
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            raise self.bad("convert", "makes a pooling model, which runner 'generate' cannot run")
        parse_pooler_config(self.pooler_config)
