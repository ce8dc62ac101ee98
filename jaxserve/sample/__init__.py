"""On-device sampling: per-row metadata arrays (built on the host) and the jitted sampler."""

from jaxserve.sample.metadata import (
    DEFAULT_MAX_ALLOWED_TOKENS,
    DEFAULT_MAX_LOGIT_BIAS,
    SamplingMetadata,
    SamplingTable,
    sampling_arrays,
)
from jaxserve.sample.sampler import SamplerOutput, sample
from jaxserve.sample.truncation import DEFAULT_TOP_K_CAP

__all__ = [
    "DEFAULT_MAX_ALLOWED_TOKENS",
    "DEFAULT_MAX_LOGIT_BIAS",
    "DEFAULT_TOP_K_CAP",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingTable",
    "sample",
    "sampling_arrays",
]
