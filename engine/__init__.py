"""The model side: runner, attention, sampler, tokenizer, engine loop.

Empty on purpose: `import engine.protocol` (what api/ uses) must not load torch.
"""
