"""Rewritten layers: fused and packed linears, batch-invariant modules."""
