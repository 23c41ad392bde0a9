"""Paged attention: the torch path, the batch-invariant tiles, the C++ decode kernel, the compiled op."""
