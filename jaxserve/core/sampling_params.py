"""Per-request sampling parameters (field names and defaults follow vLLM).

``__post_init__`` checks what a request's parameters mean on their own (ranges, types); what
depends on the engine (vocabulary, ``max_model_len``, static widths) is checked by the engine's
``InputProcessor``. Both raise ``InvalidRequestError`` naming the field; no check lives twice.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

from jaxserve.core.structured_outputs import StructuredOutputsParams
from jaxserve.exceptions import InvalidRequestError

# Below this temperature sampling is treated as argmax; dividing logits by ~0 would overflow.
SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(x: object) -> bool:
    # bool is an int subclass; True as max_tokens is almost certainly a client bug.
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """Sampling knobs of one request.

    ``top_k`` 0 or -1 and ``top_p`` 1.0 disable those filters; ``max_tokens=None`` means "up to
    ``max_model_len``" (resolved by the scheduler). ``stop`` is normalised to a list.
    A greedy request (``temperature < 1e-5``) has ``top_p``, ``top_k`` and ``min_p`` reset to
    their neutral values, so the sampler never needs to special-case them.
    ``all_stop_token_ids`` (vLLM's name) is ``stop_token_ids`` plus the model's EOS ids unless
    ``ignore_eos``, once the engine has recorded them (``update_from_eos``): the ids that
    ``min_tokens`` keeps out of the first outputs.
    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar (a
    dict of its fields is accepted and converted).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    _eos_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        # After this, ``stop`` and ``stop_token_ids`` are always lists.
        stops: list[str] = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop_token_ids: list[int] = list(self.stop_token_ids or [])
        self.stop, self.stop_token_ids = stops, stop_token_ids
        if self.logit_bias is not None:
            self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise InvalidRequestError("structured_outputs", str(e)) from None
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs", "must be a StructuredOutputsParams, got "
                                                            f"{type(self.structured_outputs).__name__}")
        self._verify_args(stops, stop_token_ids)
        if self.temperature < SAMPLING_EPS:
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float]:
        # JSON object keys arrive as strings ("50256": -100); accept them.
        try:
            return {int(k): float(v) for k, v in dict(bias).items()}  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias", f"must map token ids to floats, got {bias!r}") from None

    def _verify_args(self, stops: list[str], stop_token_ids: list[int]) -> None:
        def fail(field: str, reason: str) -> None:
            raise InvalidRequestError(field, reason)

        if not _is_int(self.n) or self.n < 1:
            fail("n", f"must be at least 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                fail(name, f"must be in [-2, 2], got {v}")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}")
        if not self.temperature >= 0.0:
            fail("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", f"must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            fail("seed", f"must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}, "
                               f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                fail(name, f"must be non-negative, got {v}")
        if any(not isinstance(s, str) for s in stops):
            fail("stop", f"must be a string or a list of strings, got {stops!r}")
        if any(s == "" for s in stops):
            fail("stop", "cannot contain an empty string")
        if any(not _is_int(t) or t < 0 for t in stop_token_ids):
            fail("stop_token_ids", f"must be non-negative integers, got {stop_token_ids!r}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                fail("allowed_token_ids", "must not be empty (no token could be sampled)")
            if any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                fail("allowed_token_ids", f"must be non-negative integers, got {self.allowed_token_ids!r}")
        if self.logit_bias is not None:
            if any(t < 0 for t in self.logit_bias):
                fail("logit_bias", f"token ids must be non-negative, got {self.logit_bias!r}")
            if any(v != v or v in (float("inf"), float("-inf")) for v in self.logit_bias.values()):
                fail("logit_bias", f"biases must be finite, got {self.logit_bias!r}")

    def update_from_eos(self, eos_token_ids: list[int]) -> None:
        """Record the model's EOS ids (the engine does, per request, before the core sees it)."""
        self._eos_token_ids = [] if self.ignore_eos else list(eos_token_ids)

    @property
    def all_stop_token_ids(self) -> list[int]:
        """``stop_token_ids`` then the recorded EOS ids, each once."""
        return list(dict.fromkeys([*(self.stop_token_ids or []), *self._eos_token_ids]))

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
