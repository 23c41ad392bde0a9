"""The compiled step: torch.compile (inductor) over the model's decoder, token counts bucketed.

What is compiled is the decoder body (embeddings, every layer, the final norm) of the HF
model, called as `decoder(input_ids=[1, T], position_ids=[1, T])`; attention inside it is the
opaque custom op of engine/attention/compile_op.py, so the graph runs unbroken from the embedding to
the norm. The LM head stays outside: it is applied only to the rows whose logits the step
needs (a handful of rows against T), one matmul that compiling would not speed up, and
whose row count would otherwise be one more shape to compile for.

Nothing here assumes a module type: the decoder is whatever `get_decoder()` returns, so
quantized linear modules (or any other swap done at load) compile the same way.

Shapes. A packed step of T tokens runs as the smallest bucket >= T (padding tokens: id 0,
position 0; the op neither attends nor writes them, and every other layer is row-wise, so
they cannot touch the real rows). Each bucket is one graph, compiled at start-up by
`warm_up`; a step larger than the biggest bucket (none, since the largest bucket is the
step's token budget) would compile on first use. `dynamic=True` instead marks T dynamic:
one graph for every T >= 2 (T == 1 is specialised by dynamo), no padding.

Artifacts. Inductor's FX graph cache and AOT autograd cache are on and pointed under the
engine's cache root (`<cache_root>/torch_compile`), so a second start with the same model,
dtype and torch reloads the compiled code instead of generating it.

The wrapper. On the CPU the code that calls the graph's kernels one after the other is C++
(inductor's `cpp_wrapper`), not Python: at one stream a step is ~300 kernel and op calls, and
the Python wrapper's per-call cost was ~1.4 ms of a 12.6 ms step (docs/performance.md). The
wrapper's entry is compiled apart from the kernels (`cpp_wrapper_build_separate`: the glue at
-O1, the kernels at -O3, as separate files): as one file at -O3 it took the first start from
~100 s to 426 s. Setting TORCHINDUCTOR_CPP_WRAPPER yourself leaves inductor's own choice.

CUDA. The same code path runs there (tests/gpu/test_compiled_cuda.py). CUDA graphs are not
used yet: a graph replays the kernels it captured with the addresses they read, and this op
reads a new AttentionMetadata every step. Decode-only steps of a bucketed size are where
they go, once the decode metadata (slots, padded block tables, context lengths) lives in
persistent per-bucket buffers that the runner fills in place (docs/performance.md).
"""

from __future__ import annotations

import logging
import os
import resource
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.attention import compile_op  # noqa: F401  (registers torch.ops.pagedserve.paged_attention)
from engine.attention.compile_op import forward_context
from engine.attention.paged import AttentionMetadata
from engine.config import EngineConfig
from engine.worker.families import logit_transform

log = logging.getLogger(__name__)

# A cache directory the user chose wins; torch sets the variable itself once it has picked its
# default (/tmp/torchinductor_<user>), so it is read here, at import, before any compile.
_USER_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")

# Token-count buckets below the step's budget: powers of two up to 64 (decode batches and
# small mixed steps, where padding costs little), then multiples of 64 would be too many
# graphs at a 1024-token budget, so powers of two again, capped at the budget.
SMALL_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def token_buckets(max_tokens: int) -> list[int]:
    """Bucket sizes covering 1..max_tokens: SMALL_BUCKETS, then doubling, then the budget."""
    buckets = [b for b in SMALL_BUCKETS if b < max_tokens]
    size = 128
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_tokens)
    return buckets


def bucket_for(buckets: list[int], num_tokens: int) -> int:
    for b in buckets:
        if b >= num_tokens:
            return b
    return num_tokens  # beyond every bucket: its own shape (compiled on first use)


def use_cache_dir(root: Path) -> Path:
    """Point inductor's on-disk caches under root (before the first compile of the process:
    inductor reads the variable when it first needs its cache directory)."""
    path = Path(_USER_CACHE_DIR) if _USER_CACHE_DIR else root / "torch_compile"
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):  # older torch: the FX graph cache alone
        pass
    return path


def inductor_options(device: torch.device) -> dict[str, Any]:
    """Per-compile inductor settings (torch.compile's options=, so they touch no other
    compile in the process): the C++ wrapper on the CPU, unless the user set
    TORCHINDUCTOR_CPP_WRAPPER. On CUDA, inductor's defaults."""
    if device.type != "cpu" or "TORCHINDUCTOR_CPP_WRAPPER" in os.environ:
        return {}
    return {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def wants_compile(config: EngineConfig) -> bool:
    if config.enforce_eager:
        return False
    if config.batch_invariant:  # its tiled attention and fixed-split matmuls are eager code
        log.info("--batch-invariant runs the model eagerly (as --enforce-eager)")
        return False
    return True


class CompiledForward:
    """A model's decoder compiled: `hidden(ids, positions, meta)` then `logits(hidden, keep)`."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, dynamic: bool = False) -> None:
        self.decoder: torch.nn.Module = model.get_decoder()  # type: ignore[operator]
        self.head: torch.nn.Module = model.get_output_embeddings()  # type: ignore[operator]
        # Granite's and Cohere's scales, Gemma's soft cap: the CausalLM forward's last step.
        config = getattr(model, "config", None)  # (a test's toy model has none)
        self.transform = None if config is None else logit_transform(config.get_text_config())
        self.dynamic = dynamic
        self.buckets = [max_tokens] if dynamic else token_buckets(max_tokens)
        # Dynamo keeps at most cache_size_limit graphs per code object, and every runner's
        # graphs share _body's (each bucket is one; a second runner in the process, as in the
        # tests, adds its own). Past the limit it would silently run eagerly.
        limit = max(64, 2 * len(self.buckets))
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * limit)
        device = next(model.parameters()).device
        self._compiled: Callable[..., torch.Tensor] = torch.compile(
            _own_code(self._body), dynamic=False if not dynamic else None,
            options={**inductor_options(device), "guard_filter_fn": keep_input_guards})

    def _body(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(input_ids=input_ids, position_ids=position_ids,
                            use_cache=False).last_hidden_state

    def padded_size(self, num_tokens: int) -> int:
        return num_tokens if self.dynamic else bucket_for(self.buckets, num_tokens)

    def hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """input_ids/position_ids [1, padded T] -> hidden states [1, padded T, hidden]."""
        if self.dynamic and input_ids.shape[1] > 1:
            torch._dynamo.mark_dynamic(input_ids, 1)
            torch._dynamo.mark_dynamic(position_ids, 1)
        with forward_context(meta):
            return self._compiled(input_ids, position_ids)

    def warm_up_sizes(self) -> list[int]:
        # dynamic: T == 1 is its own graph (dynamo specialises sizes 0 and 1), 2 covers the rest
        # unless a module branches on its row count (the quantized linears of engine/layers/quantization/quant.py
        # switch to dense weights above a threshold): that guard splits 2.. in two, so the
        # budget is warmed too, or the first large step would recompile under a request.
        if self.dynamic:
            return sorted({1, min(2, self.buckets[-1]), self.buckets[-1]})
        return list(self.buckets)

    def warm_up(self, run: Callable[[int], object]) -> float:
        """Compile every shape now (run(size): one dummy forward of size tokens), not on a
        request's step; with a warm on-disk cache each compile is a load. -> seconds."""
        from torch._dynamo.utils import counters
        from tqdm import tqdm

        sizes = self.warm_up_sizes()
        start, cpu = time.perf_counter(), _cpu_seconds()
        for size in tqdm(sizes, desc="compiling the model forward", unit="shape", disable=None):
            run(size)
        elapsed = time.perf_counter() - start
        # CPU seconds (ours and the C++ compiler's) too: on a shared machine wall time is noise
        log.info("compiled the forward for %d token-count shape(s) in %.1f s (%.1f CPU s; "
                 "inductor cache %s: %d hit(s), %d miss(es))", len(sizes), elapsed,
                 _cpu_seconds() - cpu, os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                 counters["inductor"]["fxgraph_cache_hit"],
                 counters["inductor"]["fxgraph_cache_miss"])
        return elapsed

    def logits(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The LM head on the kept rows only: [K, vocab]."""
        logits = self.head(hidden[0].index_select(0, keep))
        return logits if self.transform is None else self.transform(logits)


# Guards that stay: the inputs' shapes, dtypes and strides (they pick the graph: a bucket, or
# T == 1 against T >= 2), the shape environment's (a dynamic T's ranges), and the global state
# that changes what a graph computes (grad mode, default device, deterministic algorithms...).
_KEPT_GUARDS = {"SHAPE_ENV", "GLOBAL_STATE", "GRAD_MODE", "DETERMINISTIC_ALGORITHMS",
                "TORCH_FUNCTION_STATE", "DEFAULT_DEVICE", "AUTOGRAD_SAVED_TENSORS_HOOKS"}
_INPUTS = {"input_ids", "position_ids"}


def keep_input_guards(entries: Any) -> list[bool]:
    """guard_filter_fn: drop the ~10,000 guards dynamo puts on the model's modules, their
    attributes and parameters, and on transformers' globals, which it re-checks on every call
    (1.9 ms of a 15 ms one-stream step, profiled). They could only fail if the model changed
    after load, and it does not: its weights are frozen, the step's metadata reaches the
    attention op through forward_context, not through an argument.

    Only in the frame of a CompiledForward's own `_body` (its `self` is one), whose code
    object is that instance's alone (`_own_code`), so no other model's call reaches its
    graphs. A frame dynamo compiles below it, after a graph break in some model's code, runs
    code every instance shares (the model class's forward): it keeps all its guards."""
    if not any(e.name == "self" and e.has_value and isinstance(e.value, CompiledForward)
               for e in entries):
        return [True] * len(entries)
    return [e.guard_type in _KEPT_GUARDS
            or (e.guard_type == "TENSOR_MATCH" and e.name in _INPUTS) for e in entries]


def _own_code(method: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The bound method with a code object of its own. Dynamo keeps its graphs per code
    object, and with the model's guards dropped (keep_input_guards) two runners in one process
    (as in the tests) would otherwise share graphs traced for one model's weights and config."""
    func: Any = method.__func__  # type: ignore[attr-defined]
    code = func.__code__.replace(co_name=func.__code__.co_name)  # a new object, same code
    own = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    return types.MethodType(own, method.__self__)  # type: ignore[attr-defined]


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the C++ compiler)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
