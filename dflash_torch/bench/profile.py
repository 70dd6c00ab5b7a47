"""Where a decoding step's time goes: a ``torch.profiler`` summary of the kernels that
some calls of a step run on a GPU (under CUDA graphs too: the profiler records the
kernels a graph replays), or of the top-level aten ops on a CPU.

The summary answers "many small kernels or slow big ones?": kernels per call, device
time per call against wall time per call (the gap is the device waiting: launches,
host syncs, Python), the time per kind of kernel (matmul, attention, fused
elementwise, copies) and the kernels that take most.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# kind of a kernel, by substrings of its lower-cased name (first match wins)
KINDS = (
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("matmul", ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "splitk", "aten::mm", "aten::addmm", "aten::linear",
                "aten::bmm", "aten::matmul")),
    ("fused (triton)", ("triton",)),
    ("copy / index", ("copy", "index", "scatter", "gather", "cat", "elementwise")),
    ("reduce", ("reduce", "argmax", "softmax")),
)


def kind_of(name: str) -> str:
    """The kind (:data:`KINDS`) of a kernel or op name; "other" when none matches."""
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def kernel_summary(fn: Callable[[], object], calls: int, device: str, top: int = 12) -> dict:
    """Profile ``calls`` calls of ``fn`` (after one unprofiled call) and summarise them.

    Args:
        fn: one step (e.g. a compiled, CUDA-graphed verify); its result is not used.
        calls: calls profiled (>= 1).
        device: ``cuda...`` summarises device kernels; otherwise top-level CPU ops.
        top: how many of the most expensive kernels to list.

    Returns:
        a dict: ``calls``; per call: ``wall_us`` (host clock, synchronised, profiler
        overhead included), ``kernels`` (launches), ``busy_us`` (summed kernel or op
        time), ``by_kind`` (``{kind: us}``); ``top``: ``[{"name", "per_call", "us"}]``
        by time, names cut to 100 characters. ``kernels`` is 0 when the profiler recorded
        no device kernel (then the numbers say nothing; check the CUPTI setup).
    """
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        wall = time.perf_counter() - t0
    if cuda:
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.events() if e.device_type == DeviceType.CPU and e.cpu_parent is None]
    per_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        per_name[e.name][0] += 1
        per_name[e.name][1] += e.time_range.elapsed_us()
    by_kind: dict[str, float] = defaultdict(float)
    for name, (_, us) in per_name.items():
        by_kind[kind_of(name)] += us / calls
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "calls": calls, "wall_us": wall * 1e6 / calls, "kernels": sum(n for n, _ in per_name.values()) / calls,
        "busy_us": sum(us for _, us in per_name.values()) / calls,
        "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [{"name": name[:100], "per_call": n / calls, "us": us / calls} for name, (n, us) in ranked],
    }


def summary_lines(label: str, s: dict) -> list[str]:
    """:func:`kernel_summary` ``s`` as printable lines (a header and a markdown table)."""
    lines = [f"{label}: {s['kernels']:.0f} kernels/call, device busy {s['busy_us']:.0f} us of {s['wall_us']:.0f} us wall "
             f"({100 * s['busy_us'] / s['wall_us']:.0f}%); by kind: "
             + ", ".join(f"{k} {us:.0f} us" for k, us in s["by_kind"].items()),
             "| kernel | per call | us per call |", "|---|---|---|"]
    lines += [f"| {t['name']} | {t['per_call']:.1f} | {t['us']:.1f} |" for t in s["top"]]
    return lines
