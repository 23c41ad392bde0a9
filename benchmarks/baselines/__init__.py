"""Baseline servers the serving benchmark compares pagedserve against.

Each is a small Starlette app speaking pagedserve's streaming `/v1/completions` protocol
(`protocol`) on the same model and dtype, so one load generator drives them all:

- `naive`: Hugging Face `generate()` one request at a time behind a lock.
- `request_batching`: the classic dynamic batcher (request queue, batch by size or timeout,
  one left-padded `generate()` per batch run to completion, per-request streaming).

`registry` describes every server the benchmark can start (these two, pagedserve itself and
`transformers serve --continuous-batching`).
"""
