"""``python -m jaxserve_server [MODEL] [flags]``: the same as ``jaxserve serve``."""

import sys

from .cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
