"""What the compiler says about one compiled program: memory per device, cost, collectives, roofline.

All byte figures are per device (an SPMD program is one program per device). Sources:
`compiled.memory_analysis()` (argument / output / temp / alias bytes; alias = outputs written into
donated arguments, so the program's peak is argument + output - alias + temp), `compiled.cost_analysis()`
on TPU (flops, bytes accessed, the compiler's own time estimate), and on GPU, whose plugin implements no
cost analysis, XLA's HLO cost analysis of the optimised module. Collectives are counted in the
optimised HLO text, with the bytes of each one's result.
"""
from __future__ import annotations

import re

import numpy as np

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "ragged-all-to-all", "collective-broadcast")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
             "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
             "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5, "f4e2m1fn": 0.5}
# `%name = <result type> all-reduce-start(` / `... all-gather(`: the op after the result type
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(re.escape(c) for c in sorted(_COLLECTIVES, key=len, reverse=True))
                 + r")(-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


def _shape_bytes(text: str) -> int:
    """Bytes of the array shapes in an HLO result type (`bf16[8,128]{1,0}` or a tuple of them)."""
    total = 0.0
    for dt, dims in _SHAPE.findall(text):
        if dt in _ITEMSIZE:
            n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) if dims else 1
            total += n * _ITEMSIZE[dt]
    return int(total)


_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_WHILE_BODY = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+)")


def _multipliers(lines: list) -> tuple[dict, set]:
    """({computation: how many times one call of the entry computation runs it}, the computations
    that run only when a conditional takes their branch). A while body runs its known trip count (1
    when unknown) times per run of the computation holding the loop; a branch at most once per run
    of the conditional (counted as once: an upper bound)."""
    comp, edges, entry = None, {}, None
    for line in lines:
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            comp = m.group(1)
            if line.startswith("ENTRY"):
                entry = comp
            continue
        if comp is None:
            continue
        w = _WHILE_BODY.search(line)
        if w:
            t = _TRIP.search(line)
            edges.setdefault(comp, []).append((w.group(1), int(t.group(1)) if t else 1, False))
        for c in _CALLED.findall(line):
            edges.setdefault(comp, []).append((c, 1, False))
        for group, one in _BRANCHES.findall(line):
            for c in ([x.strip().lstrip("%") for x in group.split(",") if x.strip()] if group else [one]):
                edges.setdefault(comp, []).append((c, 1, True))
    mult, always = {}, set()

    def visit(c, k, depth=0):
        if depth > 64 or mult.get(c, 0) >= k:
            return
        mult[c] = k
        for child, n, _ in edges.get(c, []):
            visit(child, k * n, depth + 1)

    def reach(c, depth=0):  # without entering a branch
        if depth > 64 or c in always:
            return
        always.add(c)
        for child, _, branch in edges.get(c, []):
            if not branch:
                reach(child, depth + 1)
    if entry is not None:
        visit(entry, 1)
        reach(entry)
    return mult, set(mult) - always


def collectives(hlo_text: str) -> dict:
    """{kind: {"count", "bytes", "per_step_count", "per_step_bytes"}} of the collectives in optimised HLO
    text. count / bytes: the sites in the program (async pairs counted once, at their start; bytes: the
    result's, per device; for an async start the tuple holds the operand too, so only its last element,
    the result, is counted). per_step_*: what one call executes, each site times the trip counts of the
    loops around it (a collective in the scanned layer body runs once per layer); per_step_bytes_in_branches:
    the part of per_step_bytes inside a conditional's branch, moved only on calls that take it (e.g.
    sampling's whole-row fallback; an all-greedy step skips the sampling branch)."""
    lines = hlo_text.splitlines()
    mult, branched = _multipliers(lines)
    out: dict = {}
    comp = None
    for line in lines:
        cm = _COMP.match(line)
        if cm and not line.startswith(" "):
            comp = cm.group(1)
            continue
        m = _OP.search(line)
        if not m:
            continue
        rtype, kind, start = m.group(1), m.group(2), m.group(3)
        if start and rtype.startswith("("):
            parts = _SHAPE.findall(rtype)
            rtype = "{}[{}]".format(*parts[-1]) if parts else rtype
        e = out.setdefault(kind, {"count": 0, "bytes": 0, "per_step_count": 0, "per_step_bytes": 0,
                                  "per_step_bytes_in_branches": 0})
        n, k = _shape_bytes(rtype), mult.get(comp, 1)
        e["count"] += 1
        e["bytes"] += n
        e["per_step_count"] += k
        e["per_step_bytes"] += k * n
        e["per_step_bytes_in_branches"] += k * n if comp in branched else 0
    return out


#: `%name = <result type> copy(<operand>` (or transpose): XLA spells a layout change as a copy. Not the
#: async copy-start / copy-done pairs: those move an array between memory spaces (a TPU prefetch into
#: VMEM), its layout unchanged; a relayout after such a move is a `copy` of the copy-done.
_COPY = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(copy|transpose)\(%?([\w.\-]+)")
_FUSED = re.compile(r"\bfusion\(.*?calls=%?([\w.\-]+)")
COPY_MIN_BYTES = 1 << 20


def copies(hlo_text: str, min_bytes: int = COPY_MIN_BYTES, top: int = 5) -> dict:
    """The copies a program runs: `copy` / `transpose` instructions of at least `min_bytes`
    (their result's bytes, per device) in the computations that execute as such (the entry, loop bodies,
    branches, called computations), not inside a fusion, where such an instruction is one step of a
    fused loop that writes nothing of its own. Why report them: a relayout of a pool or a weight stack
    (a layout a consumer prefers that the stored array lacks) costs its bytes in temp memory and twice
    its bytes in traffic on every call, and the memory totals do not say which array it is. Returns
    {"count", "bytes", "per_step_bytes" (each site times the trip counts of the loops around it),
    "largest": [{"shape", "op", "operand", "computation", "per_step"}] (the `top` largest per step)}."""
    lines = hlo_text.splitlines()
    mult, _ = _multipliers(lines)
    fused = set(_FUSED.findall(hlo_text))
    sites, comp = [], None
    for line in lines:
        cm = _COMP.match(line)
        if cm and not line.startswith(" "):
            comp = cm.group(1)
            continue
        if comp in fused:
            continue
        m = _COPY.match(line)
        if not m:
            continue
        rtype, op, operand = m.groups()
        n = _shape_bytes(rtype)
        if n >= min_bytes:
            k = mult.get(comp, 1)
            sites.append({"shape": rtype, "op": op, "operand": operand, "computation": comp, "bytes": n,
                          "per_step": k * n})
    sites.sort(key=lambda x: -x["per_step"])
    return {"count": len(sites), "bytes": sum(x["bytes"] for x in sites),
            "per_step_bytes": sum(x["per_step"] for x in sites),
            "largest": [{k: v for k, v in x.items() if k != "bytes"} for x in sites[:top]]}


_KERNEL = re.compile(r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton)"')


def kernel_calls(hlo_text: str) -> int:
    """Pallas kernels compiled into the program: Mosaic (`tpu_custom_call`) and Triton custom calls. Zero
    for a program whose kernels ran in interpret mode (lowered to plain XLA ops)."""
    return len(_KERNEL.findall(hlo_text))


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    arg, out, tmp, alias = (int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.temp_size_in_bytes),
                            int(m.alias_size_in_bytes))
    return {"argument_bytes": arg, "output_bytes": out, "temp_bytes": tmp, "alias_bytes": alias,
            "total_bytes": arg + out - alias + tmp}


def cost(compiled, platform: str) -> dict:
    """{"flops", "bytes_accessed", "compiler_seconds"} per device (compiler_seconds: TPU's own estimate
    of the step's time, None where the compiler gives none)."""
    ca = None
    if platform == "tpu":
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    if not ca:
        import jax
        from jax._src.lib import _jax
        ca = {}
        for mod in compiled.runtime_executable().hlo_modules():
            for k, v in _jax.hlo_module_cost_analysis(jax.extend.backend.get_backend("cpu"), mod).items():
                ca[k] = ca.get(k, 0.0) + v
    est = ca.get("optimal_seconds")
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "compiler_seconds": float(est) if est is not None and est > 0 else None}


def analyse(compiled, platform: str, hbm_bandwidth: float, peak_flops: float, tokens: int) -> dict:
    """memory + cost + collectives + copies (of at least 1 MiB) of a compiled program, with its roofline
    time max(bytes accessed / HBM bandwidth, flops / peak) and the tokens/s that time implies for a call
    producing `tokens` tokens."""
    r = memory(compiled)
    r.update(cost(compiled, platform))
    text = compiled.as_text()
    r["collectives"] = collectives(text)
    r["kernel_calls"] = kernel_calls(text)
    r["copies"] = copies(text)
    r["hbm_seconds"] = r["bytes_accessed"] / hbm_bandwidth
    r["roofline_seconds"] = max(r["hbm_seconds"], r["flops"] / peak_flops)
    r["tokens_per_step"] = tokens
    r["roofline_tokens_per_second"] = tokens / r["roofline_seconds"] if r["roofline_seconds"] else None
    return r
