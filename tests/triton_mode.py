"""Pins Triton's interpreter before any test can import Triton in compiled mode.

Triton chooses interpreted or compiled versions of its own library at its first import, once per
process. Without a GPU only the interpreter can run a kernel, yet building or loading a
transformers model imports Triton (compiled) as a side effect, so whichever test ran first would
decide. Test folders that run Triton interpreted call :func:`pin_triton_interpreter` while pytest
collects them (collection ends before any test runs), so every subset of the suite behaves alike.
"""

from __future__ import annotations


def pin_triton_interpreter() -> None:
    """On a GPU-less machine with triton and torch installed, import Triton in interpreter mode
    now; elsewhere do nothing (with a GPU, Triton compiles)."""
    import jax

    from pallas_kernels import triton_attention

    if jax.default_backend() == "cpu" and triton_attention.triton_interpret_available()[0]:
        triton_attention._interpreted_kernels()
