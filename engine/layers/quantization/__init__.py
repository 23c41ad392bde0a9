"""Weight-only quantized linears (int4/int8) and a GGUF's own blocks."""
