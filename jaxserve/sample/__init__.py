"""On-device sampling: per-row metadata arrays (built on the host) and the jitted sampler."""

from jaxserve.sample.metadata import (
    DEFAULT_MAX_ALLOWED_TOKENS,
    DEFAULT_MAX_LOGIT_BIAS,
    SAMPLING_EPS,
    SamplingMetadata,
    SamplingMetadataBuilder,
    build_sampling_arrays,
    validate_sampling_params,
)
from jaxserve.sample.sampler import SamplerOutput, sample
from jaxserve.sample.truncation import DEFAULT_TOP_K_CAP

__all__ = [
    "DEFAULT_MAX_ALLOWED_TOKENS",
    "DEFAULT_MAX_LOGIT_BIAS",
    "DEFAULT_TOP_K_CAP",
    "SAMPLING_EPS",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingMetadataBuilder",
    "build_sampling_arrays",
    "sample",
    "validate_sampling_params",
]
