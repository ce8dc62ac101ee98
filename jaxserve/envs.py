"""Every environment variable jaxserve reads, in one place.

Each setting is read when asked for, not at import, so a test or a launcher may set it late.
"""

from __future__ import annotations

import os
from pathlib import Path

JAXSERVE_CACHE_DIR = "JAXSERVE_CACHE_DIR"
"""Folder of every jaxserve artefact (XLA compilation cache, demo models, built kernels)."""
JAXSERVE_HASH_SEED = "JAXSERVE_HASH_SEED"
"""Fixes the root of the prefix-cache hash chain (random per process when unset)."""
JAXSERVE_API_KEY = "JAXSERVE_API_KEY"
"""Bearer key the server requires when ``--api-key`` is not given."""
JAX_SKIP_CUDA_CONSTRAINTS_CHECK = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
"""JAX's own: lets the CUDA plugin load on a machine without a GPU, for compile-only devices."""
XLA_PYTHON_CLIENT_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
"""XLA's own: the share of GPU memory its allocator preallocates (0.75 when unset). A GPU engine
sets it to ``gpu_memory_utilization`` when the user has not, before JAX starts its backends."""
JAXSERVE_PROFILER_DIR = "JAXSERVE_PROFILER_DIR"
"""Where ``LLM.start_profile()`` writes its traces when not given a folder (vLLM's
``VLLM_TORCH_PROFILER_DIR``); default: the ``profiles`` folder of the cache."""
JAX_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
"""JAX's own: ``host:port`` of the distributed runtime's coordinator (rank 0); the defaults of
``--master-addr`` and ``--master-port``."""
JAXSERVE_LOG_LEVEL = "JAXSERVE_LOG_LEVEL"
"""The ``jaxserve`` command's log level (``debug`` also prints the traceback of a start-up error)."""

# Hugging Face's own variables, read here with huggingface_hub's meaning so that a test or a
# launcher may set them after huggingface_hub was imported (it reads them once, at import).
HF_HOME = "HF_HOME"
HF_HUB_CACHE = "HF_HUB_CACHE"
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"


def cache_dir() -> Path:
    """``$JAXSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxserve`` (``~/.cache/jaxserve``)."""
    root = os.environ.get(JAXSERVE_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxserve")
    return Path(root)


def kernel_build_dir() -> Path:
    """Where kernels built on first use (the ``cpu`` attention backend's library) live."""
    return cache_dir() / "kernels"


def profiler_dir() -> Path:
    """``$JAXSERVE_PROFILER_DIR``, else ``profiles`` in :func:`cache_dir`."""
    explicit = os.environ.get(JAXSERVE_PROFILER_DIR)
    return Path(explicit).expanduser() if explicit else cache_dir() / "profiles"


def hash_seed() -> str | None:
    return os.environ.get(JAXSERVE_HASH_SEED)


def api_key() -> str | None:
    return os.environ.get(JAXSERVE_API_KEY) or None


def xla_mem_fraction() -> float | None:
    value = os.environ.get(XLA_PYTHON_CLIENT_MEM_FRACTION)
    return float(value) if value else None


def set_xla_mem_fraction(fraction: float) -> None:
    """Read by XLA when its GPU client starts; a later change has no effect in this process."""
    os.environ[XLA_PYTHON_CLIENT_MEM_FRACTION] = f"{fraction:.4f}"


def allow_cuda_plugin_without_gpu() -> None:
    """The CUDA plugin checks the driver's versions when it loads, which fails with no GPU; an
    ahead-of-time compile for a GPU needs the plugin and no driver. Set before JAX's first backend."""
    os.environ.setdefault(JAX_SKIP_CUDA_CONSTRAINTS_CHECK, "1")


def jax_coordinator_address() -> tuple[str | None, int | None]:
    """``$JAX_COORDINATOR_ADDRESS`` split into host and port (either None when absent); an IPv6
    host keeps its brackets."""
    value = (os.environ.get(JAX_COORDINATOR_ADDRESS) or "").strip()
    if not value:
        return None, None
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or (host.count(":") and not host.endswith("]")):
        return value, None
    return host or None, int(port)


def log_level() -> str | None:
    """``$JAXSERVE_LOG_LEVEL`` upper-cased (``DEBUG``, ``INFO`` ...), or None when unset."""
    value = os.environ.get(JAXSERVE_LOG_LEVEL)
    return value.strip().upper() if value and value.strip() else None


def hf_hub_cache() -> Path:
    """The hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/huggingface/hub``)."""
    explicit = os.environ.get(HF_HUB_CACHE) or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get(HF_HOME) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface")
    return Path(home).expanduser() / "hub"


def hf_hub_offline() -> bool:
    """``$HF_HUB_OFFLINE`` (or transformers' older ``$TRANSFORMERS_OFFLINE``) set to a true value."""
    value = os.environ.get(HF_HUB_OFFLINE) or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")
