"""The cpu attention backend's library, built ahead: the engine starts this build in a background
thread before it loads the model, so the C++ compiler's seconds overlap the loading instead of
adding to it. The runner's registration (``pallas_kernels.cpu_attention_available``) then finds
the build done, or waits for the one in flight."""

from __future__ import annotations

from jaxserve import envs
from pallas_kernels import cpu_attention


def prebuild_cpu_kernel() -> None:
    cpu_attention.prebuild(envs.kernel_build_dir())
