"""The PTX version of Triton kernels, matched to the jaxlib that loads them.

Triton 3.9 compiles for sm_90 with the newest ptxas it ships (CUDA 13), so it emits PTX ISA 9.x,
which a CUDA 12 toolchain rejects ("Unsupported .version 9.4; current version is '8.8'"), and
jax-triton hands that PTX to the jaxlib. With a CUDA 12 jaxlib, :func:`pin_ptx_to_cuda12` points
Triton at the CUDA 12 ptxas it also ships, so the PTX it emits is ISA 8.x. It must run before
Triton compiles anything in the process (Triton reads the setting once).
"""

from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger("jaxserve")

# Triton picks its ptxas by architecture; this knob overrides the one used from sm_90 on.
PTXAS_SM90_ENV = "TRITON_PTXAS_BLACKWELL_PATH"


def jaxlib_cuda_major() -> int | None:
    """12 or 13 when that CUDA plugin of jaxlib is installed, None when neither is."""
    if importlib.util.find_spec("jax_plugins") is None:
        return None
    for major in (13, 12):
        if importlib.util.find_spec(f"jax_plugins.xla_cuda{major}") is not None:
            return major
    return None


def pin_ptx_to_cuda12() -> str | None:
    """With a CUDA 12 jaxlib, make Triton compile sm_90 kernels with its CUDA 12 ptxas, so their
    PTX is an ISA CUDA 12 accepts. Returns what was done (logged), None when nothing was needed.
    Raises RuntimeError when no CUDA 12 ptxas can be found (the triton backend cannot run)."""
    if jaxlib_cuda_major() != 12 or os.environ.get(PTXAS_SM90_ENV):
        return None
    from triton import knobs

    tool = knobs.nvidia.ptxas
    major = int(str(tool.version).split(".")[0]) if tool and tool.version else None
    if major != 12:
        raise RuntimeError(f"the triton backend needs a CUDA 12 ptxas for this CUDA 12 jaxlib; triton's is {major}")
    os.environ[PTXAS_SM90_ENV] = tool.path
    message = (f"triton: compiling sm_90 kernels with ptxas {tool.version} ({tool.path}): the CUDA 12 jaxlib "
               "cannot load the PTX 9.x that triton's CUDA 13 ptxas would make it emit")
    logger.info(message)
    return message
