"""The engine core: the synchronous LLMEngine, its step loop, the core process and what a step reports."""
