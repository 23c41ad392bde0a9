"""ModelRunner: one packed forward per engine step over a paged KV pool.

`execute()` turns a SchedulerOutput into tensors in one place (`_prepare`: model inputs,
attention metadata and the sampler's batch, all through `step_tensors.to_device`), runs the
HF model once over all scheduled tokens ([1, T], positions restarting per sequence, no
padding), computes logits only at the positions that need them, and samples.

The runner keeps no per-request state: everything a step needs comes with the
SchedulerOutput's sequences, so there is nothing to release when a request ends.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import torch

from engine.attention import cpu_kernels, kv_int8
from engine.attention import paged as attention
from engine.attention.paged import AttentionMetadata, build_metadata
from engine.attention.scores import ScoreRule
from engine.config import EngineConfig
from engine.layers import batch_invariant
from engine.sample.sampler import compute_prompt_logprobs, sample
from engine.sample.sampling_batch import GrammarMasks, SamplingBatch, SamplingBatchBuilder
from engine.worker import huge_pages, memory
from engine.worker.cache_paths import cache_root
from engine.worker.compile import CompiledForward, use_cache_dir, wants_compile
from engine.worker.families import layer_windows
from engine.worker.file_pages import release_freed
from engine.worker.loader import load_model
from engine.worker.runner_output import RequestFault, RunnerOutput, TokenLogprobIds
from engine.worker.step_tensors import to_device
from scheduler.block_manager import NULL_BLOCK
from scheduler.output import SchedulerOutput
from scheduler.sequence import Sequence

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class PromptRows:
    """A sequence's prompt positions that report logprobs this step: logits rows
    [row, row + count), predicting prompt_targets[offset : offset + count]."""

    seq_id: str
    row: int
    count: int
    offset: int
    top_n: int


@dataclass(frozen=True, slots=True, eq=False)
class StepInputs:
    input_ids: torch.Tensor  # [1, T] (padded to a bucket when compiled)
    position_ids: torch.Tensor  # [1, T]
    metadata: AttentionMetadata
    keep: torch.Tensor  # [K] packed positions whose logits are computed
    sample_ids: list[str]  # the sequences that sample, in batch order (a drafting one 1 + k
    # times in a row: once per position it scores)
    sample_rows: torch.Tensor | None  # [S] their logits rows; None when none samples
    samples_every_row: bool  # sample_rows is 0..K-1: the logits are sampled as they are
    sampling: SamplingBatch | None  # their sampling inputs
    prompt_rows: list[PromptRows]
    prompt_targets: torch.Tensor | None  # [P] the prompt token each prompt row predicts
    drafts: dict[str, list[int]]  # the speculating sequences' drafts (SchedulerOutput's)


@dataclass(slots=True)
class _Flat:
    """A step's Python lists before they become tensors (see ModelRunner._flatten)."""

    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decodes: list[tuple[list[int], int]] = field(default_factory=list)
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)
    sample_rows: list[tuple[int, int]] = field(default_factory=list)  # (batch index, row)
    prompt_rows: list[PromptRows] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.scheduler.block_size

    # ------------------------------------------------------------------ loading

    def load(self) -> None:
        torch.set_num_threads(self.config.num_threads or _usable_cores())
        torch.manual_seed(self.config.seed)
        attention.register()
        loaded = load_model(self.config.model, self.config.device, self.config.dtype,
                            self.config.quantization, self.config.batch_invariant)
        self.model = loaded.model
        self.model.set_attn_implementation(attention.ATTN_NAME)
        if self.config.batch_invariant:
            batch_invariant.enable(self.model)
        self.compiled: CompiledForward | None = None
        self.tokenizer = loaded.tokenizer
        self.facts = facts = loaded.facts
        self.device: torch.device = self.model.device
        self.dtype: torch.dtype = self.model.dtype
        self.vocab_size = facts.vocab_size
        self.eos_token_ids = facts.eos_token_ids
        self.model_display_name = facts.display_name
        self.max_model_len = min(self.config.scheduler.max_model_len,
                                 facts.max_position_embeddings)
        self.windows = self._sliding_windows()
        self.score_rules = self._score_rules()
        # Decode attention through our C++ kernel where it builds (CPU, fp32/bf16): before
        # the pool and the warm-up, so both see the step the server will run.
        self.paged_decode_kernel = (not self.config.batch_invariant
                                    and cpu_kernels.wants_paged_decode(
                                        self.config.attention_backend, self.device,
                                        self.dtype))
        self.num_kv_blocks = self._num_blocks()
        self.kv_cache = self._new_pool(self.num_kv_blocks)
        self.sampling = SamplingBatchBuilder(self.vocab_size, self.eos_token_ids,
                                             seed=self.config.seed)
        release_freed()  # what loading freed, back to the OS: the steady RSS drops
        before_warm_up = memory.resident_bytes()
        self._warm_up()
        log.info("model %s on %s (%s): %d KV blocks of %d tokens (%s); decode attention: %s",
                 self.model_display_name, self.device, self.dtype, self.num_kv_blocks,
                 self.block_size, str(self.kv_dtype).removeprefix("torch."),
                 "C++ kernel" if self.paged_decode_kernel else "torch")
        release_freed()  # and what the warm-up steps freed
        self.memory = memory.account(self.model, self.kv_cache, before_warm_up)
        log.info("memory: %s", self.memory.describe())

    def _score_rules(self) -> tuple[ScoreRule, ...]:
        """Per layer, what its attention does beyond a causal softmax: its window, Gemma 2's
        soft cap, gpt-oss's sinks (transformers hands the last two to the attention hook as
        softcap= and s_aux=; the compiled step's op takes no such arguments, so they travel
        in the step's metadata). () when every layer is plain."""
        softcap = float(getattr(self.model.config.get_text_config(),
                                "attn_logit_softcapping", None) or 0.0)
        sinks: dict[int, torch.Tensor] = {
            int(m.layer_idx): m.sinks.detach().float().contiguous()
            for m in self.model.modules()
            if isinstance(getattr(m, "sinks", None), torch.Tensor) and hasattr(m, "layer_idx")}
        layers = self.facts.num_layers
        rules = tuple(ScoreRule(self.windows[i] if self.windows else 0, softcap, sinks.get(i))
                      for i in range(layers))
        if sinks or softcap:
            log.info("attention: %s", ", ".join(
                ([f"soft cap {softcap:g}"] if softcap else [])
                + ([f"sinks on {len(sinks)} of {layers} layers"] if sinks else [])))
        return rules if self.windows or softcap or sinks else ()

    def _sliding_windows(self) -> tuple[int, ...]:
        """Per layer, its sliding window (0: full attention); () when no layer slides
        (engine/worker/families.py reads the config)."""
        windows = layer_windows(self.model.config.get_text_config(), self.facts.num_layers)
        if windows:
            log.info("sliding-window attention: window %d on %d of %d layers",
                     max(windows), sum(1 for w in windows if w), len(windows))
        return windows

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the pool holds: the model's dtype, or int8 rows (engine/attention/kv_int8.py)."""
        return torch.int8 if self.config.kv_cache_dtype == "int8" else self.dtype

    def _new_pool(self, num_blocks: int) -> torch.Tensor:
        """One pool for all layers: [layers, K/V, blocks, kvH, block_size, row] (row: the head
        dim, + 2 for an int8 row's scale); on the CPU on huge pages where the OS has them
        (engine/worker/huge_pages.py)."""
        f = self.facts
        row = kv_int8.row_width(f.head_dim, self.kv_dtype == torch.int8)
        shape = (f.num_layers, 2, num_blocks, f.num_kv_heads, self.block_size, row)
        if self.device.type == "cpu":
            return huge_pages.zeros(shape, self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _block_bytes(self) -> int:
        f = self.facts
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        row = kv_int8.row_width(f.head_dim, self.kv_dtype == torch.int8)
        return f.num_layers * 2 * self.block_size * f.num_kv_heads * row * elem

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_free_cuda_memory()
        else:
            budget = CPU_DEFAULT_KV_BYTES
        blocks = budget // self._block_bytes()
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block "
                             f"({self._block_bytes()} bytes each)")
        return blocks

    def _profile_free_cuda_memory(self) -> int:
        """Run the largest prefill and the largest decode step once without the pool; what is
        left under the limit after the bigger of their peaks is for KV."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        before = torch.cuda.memory_allocated(self.device)
        peak = max(self._cuda_peak(self._worst_prefill),
                   self._cuda_peak(self._worst_decode_step))
        # total - free: weights, CUDA context and other processes, all already in use
        return int(total * self.config.gpu_memory_utilization) - (total - free) - (peak - before)

    def _cuda_peak(self, step: Callable[[], None]) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        step()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def _worst_prefill(self) -> None:
        """The whole token budget in one prefill whose every row is kept and scored, as a
        prompt_logprobs request's are: its [rows, vocab] logits and their float32 log-softmax
        are the step's largest transient (an 8B Llama-3 at 2048 rows: ~3 GB), which a profile
        keeping only max_num_seqs rows left out of the KV budget."""
        rows = self.config.scheduler.max_num_batched_tokens
        logits = self._dummy_forward(0, 0, rows, kv_cache=None, keep_rows=rows)
        targets = torch.zeros(logits.shape[0], dtype=torch.long, device=self.device)
        compute_prompt_logprobs(logits.float(), targets, 1)

    def _worst_decode_step(self, kv_cache: torch.Tensor | None = None) -> None:
        """max_num_seqs decodes at max_model_len context, the rest of the token budget one
        prefill: the step whose decode K/V gathers are largest (attention.decode_gather_budget
        caps each group, so this peak is what a real step can reach). Without a pool, every
        block table points at block 0 of a one-block scratch pool: sizes matter, not values."""
        s = self.config.scheduler
        num_decodes = min(s.max_num_seqs, s.max_num_batched_tokens)
        pool = kv_cache if kv_cache is not None else self._new_pool(1)
        self._dummy_forward(num_decodes, self.max_model_len,
                            s.max_num_batched_tokens - num_decodes, pool)

    def _warm_up(self) -> None:
        n = min(self.config.scheduler.max_num_batched_tokens, self.block_size * self.num_kv_blocks,
                self.max_model_len, 64 if self.device.type == "cpu" else 1 << 30)
        self._dummy_forward(0, 0, n, kv_cache=None)
        if wants_compile(self.config):
            use_cache_dir(cache_root())
            self.compiled = CompiledForward(self.model,
                                            self.config.scheduler.max_num_batched_tokens,
                                            dynamic=self.config.compile_dynamic)
            self.compiled.warm_up(lambda size: self._dummy_forward(0, 0, size, kv_cache=None))

    @torch.inference_mode()
    def _dummy_forward(self, num_decodes: int, context: int, num_prefill: int,
                       kv_cache: torch.Tensor | None,
                       keep_rows: int | None = None) -> torch.Tensor:
        """num_decodes decodes of `context` tokens whose block tables are all block 0, then
        one c == 0 prefill of num_prefill tokens (it reads nothing from the pool). New K/V go
        to block 0 (nowhere when kv_cache is None, which allows no decodes). The logits of
        `keep_rows` rows (default: a sampled row per sequence, max_num_seqs) are returned."""
        bs, dev = self.block_size, self.device
        table = [0] * -(-context // bs)
        slots = [(context - 1) % bs] * num_decodes + [p % bs for p in range(num_prefill)]
        prefills = [(num_decodes, num_prefill, 0, table)] if num_prefill else []
        meta = build_metadata(kv_cache, bs, slots, [(table, context)] * num_decodes, prefills,
                              dev, paged_decode_kernel=self.paged_decode_kernel,
                              rules=self.score_rules)
        n = num_decodes + num_prefill
        positions = [context - 1] * num_decodes + list(range(num_prefill))
        kept = self.config.scheduler.max_num_seqs if keep_rows is None else keep_rows
        keep = torch.arange(min(n, kept), device=dev)
        return self._forward(self._padded([0] * n), self._padded(positions), meta, keep)

    def _padded(self, values: list[int]) -> torch.Tensor:
        """[1, T] on the device; padded with zeros to the compiled bucket of T (see
        engine/worker/compile.py: the attention op ignores the padding rows)."""
        if self.compiled is not None:
            values = values + [0] * (self.compiled.padded_size(len(values)) - len(values))
        return to_device([values], torch.long, self.device)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 meta: AttentionMetadata, keep: torch.Tensor) -> torch.Tensor:
        """Logits [K, vocab] of the kept packed positions."""
        if self.compiled is not None:
            hidden = self.compiled.hidden(input_ids, position_ids, meta)
            return self.compiled.logits(hidden, keep)
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          attn_metadata=meta, logits_to_keep=keep).logits[0]

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, masks: GrammarMasks | None = None) -> RunnerOutput:
        """`masks`: the allowed tokens of the constrained sequences that sample this step."""
        output = RunnerOutput()
        if batch.is_empty:
            return output
        step = self._prepare(batch, masks)
        logits = self._forward(step.input_ids, step.position_ids, step.metadata, step.keep)
        self._sample(step, logits, output, batch, masks)
        self._prompt_logprobs(step, logits, output)
        return output

    def _prepare(self, batch: SchedulerOutput, masks: GrammarMasks | None = None) -> StepInputs:
        """Every input of the step, on the device, built here and only here."""
        flat = self._flatten(batch)
        dev, long = self.device, torch.long
        sample_rows = sorted(flat.sample_rows)  # batch order, as the sampler sees the rows
        sampled = [batch.seqs[i] for i, _ in sample_rows]
        rows = [r for _, r in sample_rows]
        offsets = _positions([i for i, _ in sample_rows]) if batch.draft_token_ids else None
        return StepInputs(
            input_ids=self._padded(flat.ids),
            position_ids=self._padded(flat.positions),
            metadata=build_metadata(self.kv_cache, self.block_size, flat.slots, flat.decodes,
                                    flat.prefills, dev,
                                    batch_invariant=self.config.batch_invariant,
                                    paged_decode_kernel=self.paged_decode_kernel,
                                    rules=self.score_rules),
            keep=to_device(flat.keep, long, dev),
            sample_ids=[seq.seq_id for seq in sampled],
            sample_rows=to_device(rows, long, dev) if sampled else None,
            samples_every_row=rows == list(range(len(flat.keep))),
            sampling=(self.sampling.build(sampled, dev, masks, offsets, batch.draft_token_ids)
                      if sampled else None),
            prompt_rows=flat.prompt_rows,
            prompt_targets=(to_device(flat.prompt_targets, long, dev) if flat.prompt_targets
                            else None),
            drafts=batch.draft_token_ids,
        )

    def _flatten(self, batch: SchedulerOutput) -> _Flat:
        """The batch as lists: decode tokens (n == 1, and speculating rows) first, then prefill
        chunks. In batch-invariant mode decodes go by context length, so equal widths form
        one group. A speculating row's 1 + k tokens attend as 1 + k decode queries over the
        same block table, query j seeing the context up to its own position: the decode path
        (our C++ kernel) computes each exactly as decoding that token would, where a prefill
        chunk's path costs a step ~5 ms more on the CPU."""
        invariant = self.config.batch_invariant
        drafting = batch.draft_token_ids
        order = sorted(range(len(batch.seqs)), key=lambda i: (
            batch.num_scheduled_tokens[i] != 1 and batch.seqs[i].seq_id not in drafting,
            batch.seqs[i].num_computed_tokens // self.block_size if invariant else 0))
        flat = _Flat()
        for i in order:
            seq, n = batch.seqs[i], batch.num_scheduled_tokens[i]
            c, start = seq.num_computed_tokens, len(flat.ids)
            flat.ids += batch.input_token_ids(i)
            flat.positions += range(c, c + n)
            flat.slots += (self._slot(seq.block_table, p) for p in range(c, c + n))
            table, shift = self._held_blocks(seq.block_table)
            if n == 1 or seq.seq_id in drafting:
                flat.decodes += ((table, c + 1 + j - shift) for j in range(n))
            else:
                flat.prefills.append((start, n, c - shift, table))
            first, targets = self._prompt_positions(seq, c, n)
            if targets:
                flat.prompt_rows.append(PromptRows(seq.seq_id, len(flat.keep), len(targets),
                                                   len(flat.prompt_targets),
                                                   seq.params.prompt_logprobs or 0))
                flat.prompt_targets += targets
                flat.keep += range(start + first - c, start + first - c + len(targets))
            if seq.seq_id in drafting:  # every position samples: the pending token's, each draft's
                flat.sample_rows += ((i, len(flat.keep) + j) for j in range(n))
                flat.keep += range(start, start + n)
            elif batch.samples(i):
                flat.sample_rows.append((i, len(flat.keep)))
                flat.keep.append(start + n - 1)
        return flat

    def _held_blocks(self, table: list[int]) -> tuple[list[int], int]:
        """A block table without the leading blocks the scheduler released out of a sliding
        window (NULL_BLOCK), and how many tokens they covered. Attention sees the rest as a
        context that starts at 0: K carries its rotary position already, and the window's
        mask counts back from the end, so shifting every position alike changes nothing.
        Batch-invariant mode shifts nothing: its tiles and decode groups take their widths
        from the position, and the shift depends on how the prompt was chunked (bf16 rounds
        a wider tile differently). There the released entries read block 0, masked out."""
        if not table or table[0] != NULL_BLOCK:
            return table, 0
        if self.config.batch_invariant:
            return [0 if b == NULL_BLOCK else b for b in table], 0
        k = bisect.bisect_left(table, True, key=lambda b: b != NULL_BLOCK)  # NULLs: a prefix
        return table[k:], k * self.block_size

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @staticmethod
    def _prompt_positions(seq: Sequence, c: int, n: int) -> tuple[int, list[int]]:
        """Prompt positions of this chunk still owed a prompt logprob -> (first, target ids).

        Position p predicts prompt token p + 1. Every position below the sequence's
        max_num_computed_tokens was computed, and so reported, by an earlier step: a
        recompute after preemption skips them. (Prefix-cache hits would count as computed
        without a forward; the block manager gives none to prompt_logprobs requests.)"""
        if seq.params.prompt_logprobs is None:
            return c, []
        first = max(c, seq.max_num_computed_tokens)
        end = min(c + n, seq.num_prompt_tokens - 1)
        if first >= end:
            return first, []
        return first, seq.token_ids[first + 1:end + 1]

    def _sample(self, step: StepInputs, logits: torch.Tensor, output: RunnerOutput,
                batch: SchedulerOutput, masks: GrammarMasks | None) -> None:
        """Sample the step's rows. A failure is put on the rows that fail alone (RequestFault);
        a token id outside the vocabulary never leaves here (it would index the embedding)."""
        if step.sample_rows is None or step.sampling is None:
            return
        # A decode-only step samples every row in order: no [S, V] copy (64 x 49152 bf16: 6 MB)
        rows = logits if step.samples_every_row else logits.index_select(0, step.sample_rows)
        try:
            tokens, logprobs = sample(rows, step.sampling)
        except Exception as e:  # find whose inputs it was, else re-raise
            raise self._blame(rows, step.sample_ids, batch, masks, e) from e
        bad = []
        chosen: dict[str, list[int]] = {}
        chosen_logprobs: dict[str, list[TokenLogprobIds]] = {}
        for seq_id, token, lp in zip(step.sample_ids, tokens, logprobs, strict=True):
            if not 0 <= token < self.vocab_size:
                bad.append(seq_id)
            if seq_id in step.drafts:
                chosen.setdefault(seq_id, []).append(token)
                if lp is not None:
                    chosen_logprobs.setdefault(seq_id, []).append(lp)
                continue
            output.sampled_token_ids[seq_id] = token
            if lp is not None:
                output.logprobs[seq_id] = lp
        if bad:  # the step's output is dropped with it: nothing was advanced yet
            raise RequestFault(bad, "sampled a token id outside the vocabulary")
        for seq_id, tokens_at in chosen.items():
            kept = verify(step.drafts[seq_id], tokens_at)
            output.verified_token_ids[seq_id] = kept
            if seq_id in chosen_logprobs:  # position j's logprobs are of the token chosen there
                output.verified_logprobs[seq_id] = chosen_logprobs[seq_id][:len(kept)]

    def _blame(self, rows: torch.Tensor, seq_ids: list[str], batch: SchedulerOutput,
               masks: GrammarMasks | None, error: Exception) -> Exception:
        """Sample each row alone (only after a failure: one small draw per row): the rows that
        fail by themselves are the culprits; none means the batch failed as a whole."""
        seqs = {seq.seq_id: seq for seq in batch.seqs}
        culprits = []
        for i, (seq_id, offset) in enumerate(zip(seq_ids, _positions(seq_ids), strict=True)):
            one = self.sampling.build([seqs[seq_id]], self.device,
                                      _masks_of(masks, seq_id, offset), [offset],
                                      batch.draft_token_ids)
            try:
                sample(rows[i:i + 1], one)
            except Exception:  # noqa: BLE001 - this row's inputs fail on their own
                culprits.append(seq_id)
        return RequestFault(culprits, f"sampling failed: {error}") if culprits else error

    def _prompt_logprobs(self, step: StepInputs, logits: torch.Tensor,
                         output: RunnerOutput) -> None:
        for p in step.prompt_rows:
            assert step.prompt_targets is not None
            target = step.prompt_targets[p.offset:p.offset + p.count]
            rows = logits[p.row:p.row + p.count].float()
            try:
                output.prompt_logprobs[p.seq_id] = compute_prompt_logprobs(rows, target, p.top_n)
            except Exception as e:  # one request's rows, one request's failure
                raise RequestFault([p.seq_id], f"prompt logprobs failed: {e}") from e


def _positions(owners: Iterable[Hashable]) -> list[int]:
    """Per sampled row (given its sequence, rows of one sequence adjacent), which of its
    sequence's rows it is: 0 for a sequence's only row, and 0..k for a drafting one's, whose
    row j draws output position num_output_tokens + j."""
    out: list[int] = []
    for _, rows in itertools.groupby(owners):
        out += range(sum(1 for _ in rows))
    return out


def verify(drafts: list[int], chosen: list[int]) -> list[int]:
    """The drafts kept, then the model's own token after them: `chosen` holds the token the
    sampler chose at each of the 1 + k positions (drafts[j] in its context from position
    j + 1 on). A draft is kept while it is the token chosen at its position, so each token
    kept or emitted is the one decoding would have drawn there: a greedy row's argmax, and a
    sampled row's draw with that position's uniform (a seeded row's are a pure function of
    its seed and the position). Draft d is kept with probability p(d), as rejection
    sampling keeps a deterministic proposer's, and a rejected position's token is drawn
    from p given it is not d, which is rejection sampling's residual: the output follows the
    model's distribution exactly."""
    kept = 0
    while kept < len(drafts) and chosen[kept] == drafts[kept]:
        kept += 1
    return chosen[:kept + 1]


def _masks_of(masks: GrammarMasks | None, seq_id: str, offset: int) -> GrammarMasks | None:
    """One sampled row's grammar mask out of a step's (None if it has none)."""
    i = None if masks is None else masks.index().get((seq_id, offset))
    if i is None:
        return None
    assert masks is not None
    return GrammarMasks((seq_id,), masks.bitmask[i:i + 1], (offset,))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
