"""Every environment variable jaxserve reads, in one place.

Each setting is read when asked for, not at import, so a test or a launcher may set it late.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

JAXSERVE_CACHE_DIR = "JAXSERVE_CACHE_DIR"
"""Folder of every jaxserve artefact (XLA compilation cache, demo models, built kernels)."""
JAXSERVE_HASH_SEED = "JAXSERVE_HASH_SEED"
"""Fixes the root of the prefix-cache hash chain (random per process when unset)."""
JAXSERVE_API_KEY = "JAXSERVE_API_KEY"
"""Bearer key the server requires when ``--api-key`` is not given."""


def cache_dir() -> Path:
    """``$JAXSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxserve`` (``~/.cache/jaxserve``)."""
    root = os.environ.get(JAXSERVE_CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxserve")
    return Path(root)


def hash_seed() -> Optional[str]:
    return os.environ.get(JAXSERVE_HASH_SEED)


def api_key() -> Optional[str]:
    return os.environ.get(JAXSERVE_API_KEY) or None
