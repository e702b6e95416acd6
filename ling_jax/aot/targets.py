"""Compile-only accelerator targets: TPU topologies from libtpu, NVIDIA nodes from a target description.

    t = resolve_target("tpu7x:2x2x1")        # 8 compile-only TPU7x devices
    t = resolve_target("h200x8:2")           # 2 nodes x 8 H200

Nothing here needs the hardware: `jax.experimental.topologies.get_topology_desc` returns devices that
`jit(...).lower(...).compile()` compiles for with the real compiler (libtpu's for TPU, XLA:GPU with
ptxas for NVIDIA). Per-device HBM is what the compiler itself allows for buffers (for TPU read
from its out-of-memory message, "exceeds available HBM (X G)", measured once per generation on this
libtpu), bandwidth the vendors' published HBM figure per device. Why a table: a compile-only device
reports no memory statistics.
"""
from __future__ import annotations

import dataclasses
import re

from ling_jax.checks import check_int

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One device kind: HBM bytes the compiler may use, HBM bandwidth (B/s) and dense bf16 peak (FLOP/s) per JAX device."""
    hbm_bytes: int
    hbm_bandwidth: float
    peak_flops: float


#: TPU device kinds (jax `device_kind`) -> per-device figures. HBM: the compiler's "available HBM"
#: (libtpu 0.0.42: v5e 15.75G, v5p 95.74G, v6e 31.25G, tpu7x 94.75G). Bandwidth and bf16 peak: per
#: chip from the vendor's tables, halved for tpu7x (two JAX devices per chip).
TPU_SPECS = {
    "TPU v4": DeviceSpec(int(31.25 * GIB), 1.2e12, 275e12),
    "TPU v5 lite": DeviceSpec(int(15.75 * GIB), 8.19e11, 197e12),
    "TPU v5": DeviceSpec(int(95.74 * GIB), 2.765e12, 459e12),
    "TPU v6 lite": DeviceSpec(int(31.25 * GIB), 1.64e12, 918e12),
    "TPU7x": DeviceSpec(int(94.75 * GIB), 3.69e12, 2307e12),
}


@dataclasses.dataclass(frozen=True)
class GpuKind:
    """The fields of an XLA `GpuTargetConfigProto` our compiles need, for one NVIDIA part (public specs)."""
    name: str
    memory_bytes: int
    bandwidth: float
    peak_flops: float
    sms: int = 132
    clock_ghz: float = 1.98
    l2_bytes: int = 50 * (1 << 20)
    major: int = 9
    minor: int = 0

    def target_config(self) -> str:
        """The text proto `get_topology_desc(platform="cuda", target_config=...)` reads."""
        return "\n".join([
            "gpu_device_info {",
            "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
            "  shared_memory_per_block: 49152", "  shared_memory_per_core: 233472",
            "  shared_memory_per_block_optin: 232448", "  threads_per_core_limit: 2048",
            f"  core_count: {self.sms}", "  fpus_per_core: 128",
            "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
            f"  memory_bandwidth: {int(self.bandwidth)}", f"  l2_cache_size: {self.l2_bytes}",
            f"  clock_rate_ghz: {self.clock_ghz}", f"  device_memory_size: {self.memory_bytes}",
            f"  cuda_compute_capability {{ major: {self.major} minor: {self.minor} }}",
            "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
            "}", 'platform_name: "CUDA"', "dnn_version_info { major: 9 minor: 10 patch: 0 }",
            f'device_description_str: "{self.name}"', ""])


#: NVIDIA parts: memory as the driver reports it (H100 SXM 80 GB, H200 141 GB HBM3e), HBM bandwidth
#: 3.35 / 4.8 TB/s, dense bf16 989 TFLOP/s (both Hopper, 132 SMs).
GPU_KINDS = {
    "h100": GpuKind("NVIDIA H100 80GB HBM3", 85_520_809_984, 3.35e12, 989e12),
    "h200": GpuKind("NVIDIA H200 141GB HBM3e", 151_397_597_184, 4.8e12, 989e12),
}

_GPU_NAME = re.compile(r"^(h100|h200)x([1-8])(?::(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Target:
    """Compile-only devices of one target and their per-device figures."""
    name: str
    platform: str          # "tpu" | "gpu" (ExecConfig / kernel spelling)
    devices: tuple
    spec: DeviceSpec

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind


def target_names() -> str:
    return ("any libtpu topology name (e.g. v5e:2x2, v5p:4x4x4, v6e:8x8, tpu7x:2x2x1), "
            "h100x8 / h200x8 (one 8-GPU node; h200x4 etc. for fewer GPUs) or h100x8:N / h200x8:N (N nodes)")


def resolve_target(name: str) -> Target:
    """The compile-only devices of `name` (see `target_names`); ValueError naming --target otherwise."""
    from jax.experimental import topologies

    name = str(name).strip()
    m = _GPU_NAME.match(name.lower())
    if m:
        kind, per_node, nodes = GPU_KINDS[m.group(1)], int(m.group(2)), int(m.group(3) or 1)
        check_int(nodes, f"--target {name!r}: the node count", low=1, expected=">= 1")
        topo = _topology(lambda: topologies.get_topology_desc(
            platform="cuda", topology=f"1x{nodes}x{per_node}", target_config=kind.target_config()), name,
            "the CUDA compile-only plugin (pip install -e '.[aot]')")
        return Target(name, "gpu", tuple(topo.devices), DeviceSpec(kind.memory_bytes, kind.bandwidth, kind.peak_flops))
    if ":" not in name:
        raise ValueError(f"--target {name!r} is not a target: expected {target_names()}")
    topo = _topology(lambda: topologies.get_topology_desc(topology_name=name, platform="tpu"), name,
                     "libtpu (pip install -e '.[aot]')")
    kind = topo.devices[0].device_kind
    if kind not in TPU_SPECS:
        raise ValueError(f"--target {name!r}: device kind {kind!r} has no HBM figures (known: {', '.join(TPU_SPECS)})")
    return Target(name, "tpu", tuple(topo.devices), TPU_SPECS[kind])


def _topology(make, name: str, needs: str):
    try:
        return make()
    except Exception as e:  # the plugin's own words: a bad topology name, a missing plugin
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Unknown backend" in msg or "not found" in msg.lower() or "Unable to initialize" in msg:
            raise ValueError(f"--target {name!r}: cannot load the compiler for it ({msg}); it needs {needs}") from None
        raise ValueError(f"--target {name!r}: {msg}") from None
