"""The worker: loading a model, running one packed forward over the paged KV pool, the compiled step."""
