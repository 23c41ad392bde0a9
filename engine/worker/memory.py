"""Where the engine's resident memory goes (issue 37): the weights by the form the step uses
them in, the KV pool, what the warm-up and compile added, and the rest of the process.

Logged once the model is ready and served in /metrics (`memory_bytes{kind=...}`), so a user
can see why a 1B int4 model is not ~0.7 GB resident, and a test can check that a path holds
no second copy of a weight. Tensors are counted once by their storage: a tied LM head and
its embedding, or the views MoE experts make of a stack, are one tensor.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.layers.packed_linear import PackedLinear
from engine.layers.quantization.linear import Int4Linear, Int8Linear
from engine.worker.file_pages import mapped_checkpoints

# The kinds, in the order they are logged and served.
WEIGHT_KINDS = ("dense_weights", "packed_weights", "quantized_weights", "dense_copies")


def resident_bytes() -> int:
    """This process's resident set now (VmRSS); 0 where /proc does not say."""
    return _status_bytes("VmRSS:")


def peak_resident_bytes() -> int:
    """The most this process has held resident so far (VmHWM; else ru_maxrss, in KiB on
    Linux, which the kernel updates less often)."""
    return _status_bytes("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def detach_from_files(model: nn.Module) -> int:
    """Copy into anonymous memory the tensors still backed by a memory-mapped checkpoint
    file, when they are a small part of the mapping, so it can be unmapped. -> bytes copied.

    transformers reads safetensors through mmap. Once the loader has packed or quantized the
    linears, only a few tensors (the embedding, norms) still point into the file, but they
    keep the whole mapping, and every page the load touched stays resident as file pages:
    a random Llama-3.2-1B in bf16, packed, was 4.9 GB resident, 2.3 GB of it the file; with
    its 192 MB of embedding copied out, 3.0 GB. Where the file's tensors are most of the
    mapping (a dense model used as loaded), they are the weights: kept as they are."""
    ranges = mapped_checkpoints()
    if not ranges:
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    used: set[tuple[int, int]] = set()  # this model's mappings, not another model's
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            key, _ = _storage(tensor)
            mapping = next((r for r in ranges if r[0] <= key < r[1]), None)
            if mapping is not None:
                by_storage.setdefault(key, []).append(tensor)
                used.add(mapping)
    held = sum(ts[0].untyped_storage().nbytes() for ts in by_storage.values())
    if not held or 2 * held > sum(end - start for start, end in used):
        return 0
    for tensors in by_storage.values():
        copy = tensors[0].untyped_storage().clone()
        for t in tensors:  # views and tied tensors keep sharing, now the copy
            t.data = torch.empty(0, dtype=t.dtype).set_(copy, t.storage_offset(), t.size(),
                                                         t.stride())
    return held


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters and buffers by the form they are held in:
    packed_weights: oneDNN-packed linears; quantized_weights: int4/int8 weights and their
    scales; dense_copies: the dense weights quantized modules keep for wide steps (packed or
    not); dense_weights: everything else (embeddings, norms, dense linears)."""
    totals = dict.fromkeys(WEIGHT_KINDS, 0)
    seen: set[int] = set()
    for module, kind in _module_kinds(model):
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            key, nbytes = _storage(tensor)
            if key in seen or tensor.device.type == "meta":
                continue
            seen.add(key)
            totals[kind] += nbytes
    return totals


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory a tensor holds. oneDNN's packed weights are opaque
    (no storage to ask): each is its own, of numel x element size (its padding unseen)."""
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return id(tensor), tensor.numel() * tensor.element_size()
    return storage.data_ptr(), storage.nbytes()


def _module_kinds(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every module with the kind its own tensors count as. A quantized module's dense copy
    (its `dense` child) counts as a copy whatever it is; the first listing of a module wins."""
    kinds: dict[int, tuple[nn.Module, str]] = {}
    for module in model.modules():
        if isinstance(module, (Int4Linear, Int8Linear)):
            kinds.setdefault(id(module), (module, "quantized_weights"))
            if module.dense is not None:
                for part in module.dense.modules():
                    kinds[id(part)] = (part, "dense_copies")
        elif isinstance(module, PackedLinear):
            kinds.setdefault(id(module), (module, "packed_weights"))
        else:
            kinds.setdefault(id(module), (module, "dense_weights"))
    return list(kinds.values())


@dataclass(frozen=True, slots=True)
class MemoryAccount:
    """The engine's resident memory once ready, in bytes."""

    weights: dict[str, int]  # by WEIGHT_KINDS
    kv_pool: int  # the KV cache pool
    warm_up: int  # resident growth over the warm-up steps: compiled graphs, workspaces
    resident: int  # the process's resident set when ready
    peak: int  # the most the process held resident by then (the load's transient copies)

    @property
    def other(self) -> int:
        """What the rest of the process holds: the interpreter, torch and its libraries,
        the tokenizer, allocator slack (never below 0: pool pages not yet touched are not
        resident, so the parts can exceed the resident set)."""
        counted = sum(self.weights.values()) + self.kv_pool + self.warm_up
        return max(0, self.resident - counted)

    def items(self) -> tuple[tuple[str, int], ...]:
        """(kind, bytes) for /metrics and the log, weights first."""
        return (*((k, self.weights.get(k, 0)) for k in WEIGHT_KINDS),
                ("kv_pool", self.kv_pool), ("warm_up", self.warm_up), ("other", self.other),
                ("resident", self.resident), ("peak", self.peak))

    def describe(self) -> str:
        return ", ".join(f"{kind.replace('_', ' ')} {n / 2**20:.1f} MiB"
                         for kind, n in self.items())


def account(model: nn.Module, kv_pool: torch.Tensor | None, resident_before_warm_up: int,
            ) -> MemoryAccount:
    """The account of a runner that has just warmed up."""
    resident = resident_bytes()
    return MemoryAccount(
        weights=weight_bytes(model),
        kv_pool=0 if kv_pool is None else kv_pool.untyped_storage().nbytes(),
        warm_up=max(0, resident - resident_before_warm_up) if resident_before_warm_up else 0,
        resident=resident, peak=peak_resident_bytes())
