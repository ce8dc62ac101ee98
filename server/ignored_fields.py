"""Request fields no model declares: ignored as vLLM ignores them, but never silently.

Each is logged once per request and named in the ``X-Jaxserve-Ignored-Fields`` response header,
so a client can tell that a field it sent had no effect.
"""

from __future__ import annotations

import json
import logging

from starlette.responses import Response

logger = logging.getLogger("jaxserve.server")

IGNORED_FIELDS_HEADER = "X-Jaxserve-Ignored-Fields"
# Names listed in the header; a body with more is summarised by a count.
MAX_LISTED_FIELDS = 32


def _header_safe(name: str) -> str:
    # JSON keys may hold any character; a header value must be printable ASCII.
    return json.dumps(name, ensure_ascii=True)[1:-1].replace(",", "\\u002c")


def report_ignored_fields(body, response: Response) -> Response:
    """Log and name in ``response``'s headers the fields of ``body`` that were ignored."""
    names = [_header_safe(n) for n in body.ignored_fields()]
    if names:
        logger.warning("ignored request fields that jaxserve does not know: %s", ", ".join(names))
        shown = names[:MAX_LISTED_FIELDS]
        if len(names) > len(shown):
            shown.append(f"(+{len(names) - len(shown)} more)")
        response.headers[IGNORED_FIELDS_HEADER] = ",".join(shown)
    return response
