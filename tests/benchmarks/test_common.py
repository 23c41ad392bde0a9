"""benchmarks.common: what a result file records of the machine."""

from __future__ import annotations

from benchmarks.common import KERNEL_FLAGS, cpu_features, machine_info

CPUINFO = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni avx512vl
processor\t: 1
flags\t\t: fpu amx_tile
"""


def test_cpu_features_keeps_the_kernel_flags_of_the_first_cpu_in_a_fixed_order() -> None:
    assert cpu_features(CPUINFO) == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]
    assert cpu_features("model name\t: something\n") == []


def test_machine_info_records_this_machines_cpu_features() -> None:
    feats = machine_info()["cpu_features"]
    assert isinstance(feats, list) and set(feats) <= set(KERNEL_FLAGS)
