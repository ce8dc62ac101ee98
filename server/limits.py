"""The server's default admission limits, apart from the app so that ``jaxserve --help`` shows them
without importing FastAPI."""

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
