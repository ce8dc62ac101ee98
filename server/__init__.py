"""jaxserve's OpenAI-compatible HTTP server (the folder server/, imported as ``jaxserve_server``)."""
