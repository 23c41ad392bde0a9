"""Structured outputs: the grammar backend, its compile workers, the compile cache and bitmasks."""
