"""The kernel tests run Triton's own kernel in its interpreter on a GPU-less machine."""

from tests.triton_mode import pin_triton_interpreter

pin_triton_interpreter()  # at collection, before any test here or elsewhere can import Triton
