"""What the engine records about itself: step records, request timelines, traces (vLLM's
``ObservabilityConfig``)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig


@dataclasses.dataclass
class ObservabilityConfig(SubConfig):
    max_step_records: int = 4096
    """Per-step records kept in a ring (who ran and with how many tokens, who waited and why,
    preemptions, KV blocks, bucket, timings); 0 turns step recording off."""
    max_request_timelines: int = 1024
    """Finished requests whose timelines stay readable by id (live ones always are)."""
    record_token_ids: bool = False
    """Show each request's prompt and output token ids in its timeline."""
    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP collector to send a span tree per request to (e.g. http://127.0.0.1:4318/v1/traces);
    needs the otel extra."""

    def validate(self) -> None:
        for field in ("max_step_records", "max_request_timelines"):
            if getattr(self, field) < 0:
                raise self.bad(field, "must be >= 0")
