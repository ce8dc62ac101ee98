"""The server's default admission limits, apart from the app so that ``jaxserve --help`` shows them
without importing FastAPI."""

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# Most messages in one chat request.
DEFAULT_MAX_CHAT_MESSAGES = 1024
# Seconds a client has to send its whole request body once the headers are in (408 after).
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
# Seconds a client has to send a request's line and headers once it connects or starts the request.
DEFAULT_REQUEST_HEADER_TIMEOUT_S = 30.0
# Seconds an idle keep-alive connection stays open.
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5
