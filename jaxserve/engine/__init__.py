"""The engine: EngineCore (schedule, execute, update), output processing, LLM and AsyncLLM."""
