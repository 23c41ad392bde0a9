"""Paged attention plugged into Hugging Face modules through transformers' AttentionInterface.

The runner packs every scheduled token of a step into one sequence ([1, T]); the HF
modules do projections, RoPE and MLPs on it, and call `paged_attention` per layer with
q/k/v as [1, heads, T, head_dim] and our `AttentionMetadata` (a forward kwarg). Here the
new K/V go into their pool slots and each sequence attends only to its own context, so
the work grows with each sequence's context, never with the square of T (the block-diagonal
mask that makes transformers' own continuous batching slow on CPU).

Packed order, fixed by the runner: first the decode tokens (one query per sequence,
batched into two bmm calls per group of decodes under a byte budget), then the prefill
chunks (one SDPA call each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import kv_int8
from engine.attention.invariant import tiled_prefill_attention
from engine.attention.scores import FULL, ScoreRule, cap_scores, softmax
from engine.worker.step_tensors import to_device

ATTN_NAME = "pagedserve"


# Decode attention gathers each decode's context into a padded [g, kvH, ctx, hd] K and V.
# Unbounded, that is max_num_seqs x max_model_len of K/V per layer (256 x 8192 tokens of an
# 8B GQA model: 4 GiB each), far beyond what profiling a prefill reserves. So the decodes of
# a step run in groups whose gathered K + V stay within a byte budget (the CUDA pool sizing
# profiles a decode step at this budget). On the CPU a small budget is also faster: a group
# whose K/V stay in cache between the gather and the two bmm calls. Measured on the 2-core
# EPYC (32 MiB L3), SmolLM2 shapes: 64 sequences x 512-1024 context 2-4x faster at 8 MiB
# than one gather, 16 x 512 unchanged (one group); 2 MiB groups cost more in overhead.
DECODE_GATHER_BYTES = {"cuda": 256 << 20}
CPU_DECODE_GATHER_BYTES = 8 << 20


def decode_gather_budget(device: torch.device) -> int:
    """Bytes of gathered decode K + V one group may materialise on this device."""
    return DECODE_GATHER_BYTES.get(device.type, CPU_DECODE_GATHER_BYTES)


@dataclass(frozen=True, slots=True, eq=False)
class PrefillChunk:
    start: int  # index of its first token in the packed batch
    num_tokens: int  # n: query length
    num_computed: int  # c: tokens of this sequence already in the cache
    rows: torch.Tensor | None  # its context's pool rows (see pool_rows); None when c == 0
    mask: torch.Tensor | None  # [n, c + n] bool causal mask shifted by c; None when c == 0


@dataclass(frozen=True, slots=True, eq=False)
class DecodeGroup:
    """Consecutive decodes [start, end) attended together, padded to the group's own widest
    block table (a short group does not pay for the step's longest context)."""

    start: int
    end: int
    rows: torch.Tensor  # pool rows of the group's block tables (pool_rows), padded with block 0
    mask: torch.Tensor  # [end - start, max_blocks * block_size] bool, True = a real context token
    lens: torch.Tensor  # [end - start] context lengths (a sliding window starts lens - w in)

    def window_mask(self, window: int) -> torch.Tensor:
        """The mask of a layer that sees only the last `window` tokens (0: all of them)."""
        if not window:
            return self.mask
        positions = torch.arange(self.mask.shape[1], device=self.mask.device)
        return self.mask & (positions[None, :] >= self.lens[:, None] - window)


@dataclass(frozen=True, slots=True, eq=False)
class AttentionMetadata:
    # [layers, 2, num_blocks, kv_heads, block_size, head_dim]; None only in the profiling run,
    # which is a single c == 0 prefill that reads nothing from the pool. An int8 pool's rows
    # are head_dim + 2 wide (codes, then a float16 scale: engine/attention/kv_int8.py). Head-major blocks:
    # one gather then yields each (sequence, kv head)'s context as contiguous [ctx, hd] rows,
    # which bmm reads without a transposing copy (that copy cost more than the attention).
    kv_cache: torch.Tensor | None
    write_blocks: torch.Tensor  # [T] pool block of each packed token's new K/V
    write_offsets: torch.Tensor  # [T] its offset inside that block
    num_decodes: int  # the first num_decodes packed tokens are single-token queries
    decode_groups: tuple[DecodeGroup, ...]  # they cover [0, num_decodes) in order
    prefills: tuple[PrefillChunk, ...]
    block_size: int = 16
    batch_invariant: bool = False  # see engine/attention/invariant.py
    # Set instead of decode_groups when the decodes go through the CPU kernel
    # (engine/attention/cpu_kernels.py): [D, W] block tables padded with block 0, [D] context lengths.
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # The CPU kernel's path with a pool: each layer is one fused kernel call (every new
    # token's K/V write and the decodes' attention, pagedserve_cpu::paged_decode_step), then
    # one SDPA per prefill chunk.
    fused_step: bool = False
    # Per layer, its ScoreRule (window, soft cap, sinks); empty: every layer FULL.
    rules: tuple[ScoreRule, ...] = ()

    def rule(self, layer: int) -> ScoreRule:
        return self.rules[layer] if self.rules else FULL


def build_metadata(
    kv_cache: torch.Tensor | None,
    block_size: int,
    slot_mapping: list[int],
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[int, int, int, list[int]]],
    device: torch.device,
    gather_budget: int | None = None,
    batch_invariant: bool = False,
    paged_decode_kernel: bool = False,
    rules: tuple[ScoreRule, ...] = (),
) -> AttentionMetadata:
    """decodes: (block table, context length) per decode; prefills: (start, n, c, block table).
    gather_budget: bytes of K + V one decode group may gather (default: the device's).
    batch_invariant: shapes that depend only on each sequence (engine/attention/invariant.py);
    needs the pool. paged_decode_kernel: the decodes go through the CPU kernel (the caller
    checked engine.attention.cpu_kernels.wants_paged_decode); not with batch_invariant, whose tests pin
    the torch path's shapes. rules: per layer, its ScoreRule (empty: none)."""
    invariant = batch_invariant and kv_cache is not None  # the profiling run has no pool
    kv_heads = kv_cache.shape[3] if kv_cache is not None else 1
    slots = to_device(slot_mapping, torch.long, device)  # [T]
    tables: tuple[torch.Tensor, torch.Tensor] | None = None
    groups: tuple[DecodeGroup, ...] = ()
    fused = paged_decode_kernel and kv_cache is not None and not invariant
    if fused:
        tables = _kernel_tables(decodes, device) if decodes else None
    else:
        if invariant:  # each decode padded to its own width, grouped only with equal widths
            decodes = [(bt[:-(-ctx // block_size)], ctx) for bt, ctx in decodes]
        budget = decode_gather_budget(device) if gather_budget is None else gather_budget
        spans = split_decodes([len(bt) for bt, _ in decodes], _block_gather_bytes(kv_cache),
                              budget, equal_widths=invariant)
        groups = _decode_groups(decodes, spans, block_size, kv_heads, device)
    return AttentionMetadata(
        kv_cache=kv_cache,
        write_blocks=slots // block_size,
        write_offsets=slots % block_size,
        num_decodes=len(decodes),
        decode_groups=groups,
        prefills=tuple(_prefill_chunk(*p, block_size, kv_heads, device, invariant)
                       for p in prefills),
        block_size=block_size,
        batch_invariant=invariant,
        decode_tables=tables[0] if tables else None,
        decode_lens=tables[1] if tables else None,
        fused_step=fused,
        rules=rules,
    )


def _kernel_tables(decodes: list[tuple[list[int], int]],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU kernel's inputs: block tables padded with block 0 to the widest ([D, W]; the
    kernel reads a row only up to its length) and the context lengths ([D])."""
    width = max(len(bt) for bt, _ in decodes)
    flat = [b for bt, _ in decodes for b in bt + [0] * (width - len(bt))]
    return (to_device(flat, torch.long, device).view(len(decodes), width),
            to_device([c for _, c in decodes], torch.long, device))


def _block_gather_bytes(kv_cache: torch.Tensor | None) -> int:
    """Bytes one block of one sequence adds to a decode gather: its K and V, every kv head
    (an int8 pool's gathered rows, the two float32 temporaries of their dequantization and
    the result, counted at 4 bytes)."""
    if kv_cache is None:
        return 1
    _, _, _, kv_heads, block_size, width = kv_cache.shape
    row = (width + 12 * kv_int8.head_dim_of(kv_cache) if kv_int8.is_int8(kv_cache)
           else width * kv_cache.element_size())
    return 2 * kv_heads * block_size * row


def split_decodes(num_blocks: list[int], block_bytes: int, budget: int,
                  equal_widths: bool = False) -> list[tuple[int, int]]:
    """Cut the decodes (their block-table lengths, in packed order) into consecutive
    [start, end) groups whose padded gather, size * widest table * block_bytes, stays within
    budget. A decode over the budget on its own still gets a group (of one). equal_widths:
    a group also ends where the table length changes (no decode is padded)."""
    groups: list[tuple[int, int]] = []
    start, widest = 0, 0
    for i, nb in enumerate(num_blocks):
        wider = max(widest, nb)
        if i > start and ((i + 1 - start) * wider * block_bytes > budget
                          or (equal_widths and nb != widest)):
            groups.append((start, i))
            start, wider = i, nb
        widest = wider
    if num_blocks:
        groups.append((start, len(num_blocks)))
    return groups


def _decode_groups(decodes: list[tuple[list[int], int]], spans: list[tuple[int, int]],
                   block_size: int, kv_heads: int,
                   device: torch.device) -> tuple[DecodeGroup, ...]:
    """Every group's padded tables and context lengths go to the device in one copy each."""
    if not decodes:
        return ()
    widths = [max(len(bt) for bt, _ in decodes[s:e]) for s, e in spans]
    flat = [b for (s, e), w in zip(spans, widths) for bt, _ in decodes[s:e]
            for b in bt + [0] * (w - len(bt))]
    tables = to_device(flat, torch.long, device)  # [sum of group size * width]
    ctx = to_device([c for _, c in decodes], torch.long, device)  # [D]
    groups, offset = [], 0
    for (s, e), w in zip(spans, widths):
        table = tables[offset:offset + (e - s) * w].view(e - s, w)  # [g, w]
        offset += (e - s) * w
        positions = torch.arange(w * block_size, device=device)
        groups.append(DecodeGroup(s, e, pool_rows(table, kv_heads),
                                  positions[None, :] < ctx[s:e, None], ctx[s:e]))
    return tuple(groups)


def pool_rows(tables: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Block tables [B, nb] -> the rows of a layer's pool viewed as [blocks * kvH, bs * hd]
    that hold them, ordered (sequence, kv head, block): one index_select then copies each
    (sequence, kv head)'s context out as contiguous [ctx, hd]. Built once per step, shared
    by every layer; index_select moves whole rows (10x faster here than advanced indexing)."""
    heads = torch.arange(kv_heads, device=tables.device)[None, :, None]
    return (tables[:, None, :] * kv_heads + heads).reshape(-1)


def _prefill_chunk(start: int, n: int, c: int, table: list[int], block_size: int,
                   kv_heads: int, device: torch.device, invariant: bool = False) -> PrefillChunk:
    if c == 0 and not invariant:  # the whole context is in this step's k/v: plain causal
        return PrefillChunk(start, n, 0, None, None)
    blocks = to_device(table[:-(-(c + n) // block_size)], torch.long, device)
    return PrefillChunk(start, n, c, pool_rows(blocks[None], kv_heads), causal(n, c, device))


def register() -> None:
    """Make ATTN_NAME usable as attn_implementation (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    # No dense [T, T] mask: sequences are separated by the metadata, not by a mask.
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, hd]
    key: torch.Tensor,  # [1, kvH, T, hd]
    value: torch.Tensor,  # [1, kvH, T, hd]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    attn_metadata: AttentionMetadata | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention hook. Eager steps pass attn_metadata= to the forward and attend here;
    the compiled forward passes none and goes through the opaque custom op, which reads the
    metadata from the runner's forward context (engine/attention/compile_op.py)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    if attn_metadata is None:
        return torch.ops.pagedserve.paged_attention(query, key, value, layer, scale), None
    # [1, T, H, hd], as HF's sdpa_attention_forward returns
    return attend_step(query, key, value, layer, scale, attn_metadata), None


def attend_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                scale: float, meta: AttentionMetadata) -> torch.Tensor:
    """One layer of the step: query [1, H, T, hd], key/value [1, kvH, T, hd] -> [1, T, H, hd].
    T may exceed the metadata's tokens (a compiled bucket's padding): those rows are zero."""
    if meta.fused_step:
        return fused_step(query, key, value, layer, scale, meta)
    real = meta.write_blocks.shape[0]
    out = attend(query[0, :, :real], key[0, :, :real], value[0, :, :real], layer, scale, meta)
    if real == query.shape[2]:
        return out[None]
    padded = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
    padded[0, :real] = out
    return padded


def fused_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
               scale: float, meta: AttentionMetadata) -> torch.Tensor:
    """attend_step through the CPU kernel: one call writes every new token's K/V and attends
    the decodes (rows from num_decodes on come back zero), then each prefill chunk's SDPA
    fills its rows. Measured on the 2-core Sapphire Rapids, SmolLM2 bf16, compiled, 64
    decodes + one 100-token prompt against the unfused path, alternating: 83.8 -> 81.1 ms."""
    assert meta.kv_cache is not None, "the fused step needs the pool"
    rule = meta.rule(layer)
    out = torch.ops.pagedserve_cpu.paged_decode_step(
        query, key, value, meta.kv_cache, layer, meta.write_blocks, meta.write_offsets,
        meta.decode_tables, meta.decode_lens, scale, rule.window, rule.softcap,
        rule.sink)  # [1, T, H, hd]
    if meta.prefills:
        k_pool, v_pool = meta.kv_cache[layer]
        attend_prefills(query[0], key[0], value[0], k_pool, v_pool, meta, scale, out[0], rule)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float,
           meta: AttentionMetadata) -> torch.Tensor:
    """q [H, T, hd], k/v [kvH, T, hd] of the step's T tokens -> [T, H, hd]; writes the new
    K/V into the layer's pool first."""
    k_pool: torch.Tensor | None = None
    v_pool: torch.Tensor | None = None
    if meta.kv_cache is not None:
        k_pool, v_pool = meta.kv_cache[layer]  # each [blocks, kvH, block_size, hd]
        write_kv(k_pool, v_pool, k, v, meta)
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, hd]
    rule = meta.rule(layer)
    if meta.decode_tables is not None:
        assert k_pool is not None and v_pool is not None, "decodes read the pool"
        d = meta.num_decodes
        out[:d] = torch.ops.pagedserve_cpu.paged_decode(
            q[:, :d].transpose(0, 1).contiguous(), k_pool, v_pool, meta.decode_tables,
            meta.decode_lens, scale, rule.window, rule.softcap, rule.sink)
    for group in meta.decode_groups:
        assert k_pool is not None and v_pool is not None, "decodes read the pool"
        out[group.start:group.end] = decode_attention(q[:, group.start:group.end], k_pool,
                                                      v_pool, group, scale, rule)
    attend_prefills(q, k, v, k_pool, v_pool, meta, scale, out, rule)
    return out


def attend_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_pool: torch.Tensor | None, v_pool: torch.Tensor | None,
                    meta: AttentionMetadata, scale: float, out: torch.Tensor,
                    rule: ScoreRule = FULL) -> None:
    """Each prefill chunk's attention into its rows of out [T, H, hd] (q [H, T, hd], k/v
    [kvH, T, hd]); the step's new K/V are in the pool already. `rule`: the layer's
    window, soft cap and sinks."""
    for chunk in meta.prefills:
        if meta.batch_invariant:
            # Its context from the pool, whatever part of it this step computed.
            assert k_pool is not None and v_pool is not None and chunk.rows is not None
            k_ctx = gather_context(k_pool, chunk.rows, 1, q.dtype)[0]  # [kvH, nb * bs, hd]
            v_ctx = gather_context(v_pool, chunk.rows, 1, q.dtype)[0]
            part = tiled_prefill_attention(q[:, chunk.start:chunk.start + chunk.num_tokens],
                                           k_ctx, v_ctx, chunk.num_computed, meta.block_size,
                                           scale, rule)
        else:
            part = prefill_attention(q, k, v, k_pool, v_pool, chunk, scale, rule)
        out[chunk.start:chunk.start + chunk.num_tokens] = part


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    # k, v: [kvH, T, hd]; pool[block, :, offset] is [kvH, hd]; the indexed dims go first: [T, ...]
    if kv_int8.is_int8(k_pool):
        k, v = kv_int8.quantize(k), kv_int8.quantize(v)  # [kvH, T, hd + 2]
    index = (meta.write_blocks, slice(None), meta.write_offsets)
    k_pool[index] = k.transpose(0, 1)
    v_pool[index] = v.transpose(0, 1)


def gather_context(pool: torch.Tensor, rows: torch.Tensor, batch: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """pool [blocks, kvH, bs, hd], rows from pool_rows -> [batch, kvH, nb * bs, hd] in
    `dtype`, one contiguous copy (an int8 pool's rows are dequantized from it)."""
    num_blocks, kv_heads, block_size, width = pool.shape
    flat = pool.view(num_blocks * kv_heads, block_size * width)
    context = flat.index_select(0, rows).view(batch, kv_heads, -1, width)
    return kv_int8.dequantize(context, dtype) if kv_int8.is_int8(pool) else context


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     group: DecodeGroup, scale: float, rule: ScoreRule = FULL) -> torch.Tensor:
    """q [H, g, hd], one query per sequence of the group -> [g, H, hd].

    Gathers each sequence's blocks into a padded [g, kvH, C, hd] and runs two bmm calls with
    the query heads grouped per KV head (GQA without repeating K/V). Measured on the 2-core
    Zen 5 at 16-64 sequences x 100-500 context, fp32 and bf16: faster than padded SDPA, than
    one SDPA per sequence, and than a token-major pool (whose gather needs a transpose)."""
    heads, d, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    ctx = group.mask.shape[1]
    k = gather_context(k_pool, group.rows, d, q.dtype).view(d * kv_heads, ctx, head_dim)
    v = gather_context(v_pool, group.rows, d, q.dtype).view(d * kv_heads, ctx, head_dim)
    qg = q.transpose(0, 1).reshape(d * kv_heads, heads // kv_heads, head_dim)  # q head h: kv h // G
    scores = torch.bmm(qg, k.transpose(1, 2)).view(d, kv_heads, -1, ctx).float() * scale
    if rule.softcap:
        scores = cap_scores(scores, rule.softcap)
    scores.masked_fill_(~group.window_mask(rule.window)[:, None, None, :], float("-inf"))
    sink = None if rule.sink is None else rule.sink.view(1, kv_heads, -1, 1)
    probs = softmax(scores, sink).to(q.dtype).view(d * kv_heads, -1, ctx)
    return torch.bmm(probs, v).view(d, heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pool: torch.Tensor | None, v_pool: torch.Tensor | None,
                      chunk: PrefillChunk, scale: float, rule: ScoreRule = FULL) -> torch.Tensor:
    """One prefill chunk: q [H, T, hd] (packed) -> [n, H, hd]; `rule.window`: query i (at
    c + i) sees only keys after c + i - window (0: all before it)."""
    s, n, c = chunk.start, chunk.num_tokens, chunk.num_computed
    window = rule.window
    qs = q[None, :, s:s + n]  # [1, H, n, hd]
    mask: torch.Tensor | None = None  # None: plain causal over the chunk
    if chunk.rows is None:
        ks, vs = k[None, :, s:s + n], v[None, :, s:s + n]
        if window and n > window or not rule.plain:
            mask = causal(n, 0, q.device)
            mask = windowed(mask, 0, window) if window and n > window else mask
    else:
        assert k_pool is not None and v_pool is not None and chunk.mask is not None
        ks = gather_context(k_pool, chunk.rows, 1, q.dtype)[:, :, :c + n]  # [1, kvH, c + n, hd]
        vs = gather_context(v_pool, chunk.rows, 1, q.dtype)[:, :, :c + n]
        mask = windowed(chunk.mask, c, window) if window and c + n > window else chunk.mask
    if not rule.plain:
        assert mask is not None
        out = explicit_attention(qs, ks, vs, mask, scale, rule)
    elif mask is None:  # the window covers the chunk: plain causal
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out[0].transpose(0, 1)  # [n, H, hd]


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float, rule: ScoreRule) -> torch.Tensor:
    """SDPA's result for q [1, H, n, hd] over k, v [1, kvH, ctx, hd] and a bool mask [n, ctx],
    with the rule's soft cap and sinks, which SDPA cannot apply. One KV head's query group
    at a time: the float32 scores of all heads at once ([H, n, ctx]: 4 GiB for 64 heads x a
    2048-token chunk x 8k context) would be kvH times what one group holds."""
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    out = q.new_empty(q.shape)
    for j in range(kv_heads):
        heads = slice(j * group, (j + 1) * group)
        scores = torch.matmul(q[0, heads], k[0, j].transpose(0, 1)).float() * scale  # [G, n, ctx]
        if rule.softcap:
            scores = cap_scores(scores, rule.softcap)
        scores.masked_fill_(~mask, float("-inf"))
        sink = None if rule.sink is None else rule.sink[heads].view(-1, 1, 1)
        out[0, heads] = torch.matmul(softmax(scores, sink).to(q.dtype), v[0, j])
    return out


def causal(n: int, c: int, device: torch.device) -> torch.Tensor:
    """[n, c + n] bool: query i (at position c + i) sees keys 0 .. c + i."""
    pos = torch.arange(c + n, device=device)
    return pos[None, :] <= (c + torch.arange(n, device=device))[:, None]


def windowed(mask: torch.Tensor, c: int, window: int) -> torch.Tensor:
    """A causal [n, c + n] mask cut to a sliding window: query i also needs key position
    > c + i - window (the last `window` tokens, itself included, as transformers' mask)."""
    n, total = mask.shape
    pos = torch.arange(total, device=mask.device)
    return mask & (pos[None, :] > (c + torch.arange(n, device=mask.device))[:, None] - window)
