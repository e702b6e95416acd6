"""`ExecConfig`: every execution choice of the model, as named fields of one frozen dataclass.

Why one object: the same parameters run as a cache-free forward, a chunked prefill, a decode
step, a speculative verification and a training step, on CPU, TPU or GPU, on one device or a
mesh. Each of those is a *choice of how to compute*, never a change of what is computed, so it
lives here, outside the parameters. An ExecConfig is hashable and static under `jit`: a jitted
function that takes one compiles once per distinct value.

`ExecConfig.for_backend(platform, cfg)` is the one place where defaults depend on the backend
(Pallas on TPU/GPU, XLA on CPU; KDA chunk 16 on CPU, 32 on GPU, 64 on TPU; capacity-batched experts on
XLA:CPU, where `ragged_dot` is dense, and weights-first linears over few rows) or on the model's
shape (layer loop). The model carries the resolved config as `model.exec`; a call may pass another
(`model.exec.replace(kernels="pallas")`). What kind of call it is (prefill, decode, verify, ...)
is not an execution choice: it is the model call's `mode` argument (`call_mode.CallMode`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from ling_jax.checks import check_int

KERNELS = ("xla", "pallas")
EXPERT_PATHS = ("auto", "gather", "grouped")
GROUPED_MATMULS = ("capacity", "ragged")
MLA_FORMS = ("auto", "expanded", "absorbed")
LAYER_LOOPS = ("scan", "unroll")
PLATFORMS = ("tpu", "gpu", "cpu")
POOL_LAYOUTS = ("default", "token_rows")

#: The layer loop unrolls schedules of at most this many layers whose hidden size is at least
#: UNROLL_MIN_HIDDEN. Why both: a scan makes XLA:CPU copy each layer's weight slices (cost ∝ weight
#: bytes), while unrolling costs compile time ∝ layer count; small test models compile faster
#: scanned and lose nothing, the 72-layer release compiles 6 layer bodies instead of 72.
UNROLL_MAX_LAYERS = 24
#: XLA:CPU: linear layers over at most this many rows run weights-first (`ExecConfig.weights_first_rows`);
#: measured 1.0–1.2× at 64 rows and slower from ~128 (tools/bench_small_matmul.py).
CPU_WEIGHTS_FIRST_ROWS = 64
UNROLL_MIN_HIDDEN = 512
#: KDA chunk on GPU: Triton compiles the chunk kernel's [C, C] forward substitution in time superlinear
#: in C (measured with `ling-jax aot` on a 2-core host, H100 target: C = 16 / 32 / 64 in 10 s / 48 s /
#: 6 min); 32 keeps the start-up compile under a minute. Its run time against 64 is to be measured on a GPU.
GPU_KDA_CHUNK = 32


def normalize_platform(platform: str) -> str:
    """'tpu' | 'gpu' | 'cpu' for a JAX platform name (cuda / rocm are 'gpu')."""
    p = str(platform).lower()
    return "gpu" if p in ("cuda", "rocm", "gpu") else p


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"ExecConfig.{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ExecConfig:
    """How to run the model (never what it computes: every choice gives the same numbers).

    kernels: "xla" | "pallas": KDA chunk/step, absorbed-MLA core and FP8 linear kernels
        (`pallas_kernels`; a Pallas call on CPU runs in interpret mode, for tests).
    experts: routed-expert path. "gather" reads only the selected experts' weights (few tokens),
        "grouped" one grouped matmul over tokens sorted by expert, "auto" picks gather while
        3·N·k ≤ E (gather copies each selected expert; grouped reads every expert once).
    grouped_matmul: how "grouped" runs: "ragged" (`ragged_dot_general`, a native grouped GEMM on
        TPU/GPU) or "capacity" (dense batched matmuls over per-expert buffers + spill; XLA:CPU).
    kda_chunk: tokens per chunk of the chunked KDA scan (forward, prefill and training calls;
        a decode or verify call runs KDA token by token: `call_mode.CallMode`).
    mla_form: "expanded" | "absorbed" | "auto" (expanded when the keys are the new tokens only,
        absorbed over a cache).
    layer_loop: "scan" (repeated layer groups scanned: short compiles) | "unroll" (each layer reads
        its own weights in place: faster on XLA:CPU for shallow, wide models).
    weights_first_rows: float linear layers whose input has 2 … this many rows compute
        `(W·xᵀ)ᵀ`, the weight the streamed operand (`pallas_kernels.matmul.linear`: XLA:CPU's GEMM
        otherwise repacks the weight every call; 1.6–2.3× faster at 2–16 rows). 0 = off (TPU/GPU).
    native_experts: routed experts on the XLA:CPU "capacity" path run the native CPU kernel
        (`pallas_kernels.experts.cpu_kernel`, each used expert read once in place, built on first
        use) at any token count (it beats the capacity buffers from 8 to 2,048 tokens, measured);
        float32 only, the XLA loop / capacity path when it cannot be built. Training turns it off
        (forward-only kernel).
    native_attention: the absorbed MLA core on XLA:CPU runs the native CPU kernel
        (`pallas_kernels.mla.cpu_kernel`: keys read in place from the cache or the engine's pages,
        blockwise online softmax, built on first use): ~6x the XLA blockwise prefill's rate
        (BENCHMARKS.md "A native CPU attention kernel"); float32 only, the XLA forms when it cannot
        be built. Training turns it off (forward-only kernel).
    native_kda: a decode call's KDA delta rule on XLA:CPU runs the native CPU kernel on the states
        where they are stored (`pallas_kernels.kda.cpu_kernel`, `kda.kda_in_place`: the engine's slot
        pool or `generate`'s cache updated in place, no gather or scatter of rows): XLA:CPU ran the
        step as several passes over every state (BENCHMARKS.md "The KDA decode step in place");
        float32, one device, the XLA reference when it cannot be built.
    native_linear: in a scanned layer loop on XLA:CPU, a float32 linear (or router) weight is read in
        place from its run's stack by the native CPU kernel (`pallas_kernels.linear.cpu_kernel`; the
        layer gets `linear.TableRows`, its rows of the stack; MLA's kv_b_proj per head, `mla.absorbed_kv_b`)
        in calls of any number of rows (decode, verify, prefill): XLA:CPU copies a dynamic slice of a
        stack before the dot that reads it, so every scanned decode step wrote each dense weight once
        more and read it twice (the mid config scanned, 8-row decode step 166 -> 130 ms, BENCHMARKS.md
        "Thirty-first session"; prefill-sized calls level with the slice + dot, "Thirty-second
        session"). One device, float32; the XLA slice when it cannot be built. Training turns it off.
    attn_block: keys per block of the XLA blockwise MLA attention (`pallas_kernels.mla.blockwise`):
        its temporaries are [B,H,T,attn_block] scores, whatever the key count.
    prefill_chunk: tokens per model call when `generate` prefills or `forward` runs a longer
        sequence (the KDA states and MLA cache carry across calls), so activation memory is bounded
        by the chunk, not the prompt.
    remat: None, or a `jax.checkpoint_policies` name: every decoder layer body is rematerialised
        under it in the backward pass (training).
    platform: "tpu" | "gpu" | "cpu" | None: the backend every Pallas kernel call targets (its block
        sizes, compiler parameters, interpret or compile). None = the host's default backend. Why a
        field: a compile-only run on a CPU host (`ling-jax aot`) compiles for a TPU or GPU target,
        so the target cannot be read from `jax.default_backend()`; `for_backend` sets it.
    pool_layout: how the engine lays its pools out in device memory. "default": the device's
        default layout; "token_rows": the k_pe page pools row-major (each token's values the minor
        dimension, as the paged write and the attention kernels read them; `serve.pools.
        token_row_formats`), every engine program pinned to that layout. Why: XLA:TPU keeps a
        64-wide minor dimension (half a lane tile) with another dimension minor, so every step
        copied each k_pe pool into the row-major layout and back (temp memory 2x the k_pe pool and
        that traffic per step, BENCHMARKS.md); row-major pads it to 128 lanes instead (+11% of the
        latent pool at the release's widths); and the KDA conv windows [slots, K-1, H·dk] stored as
        K-1 lane-dense taps [slots, H·dk] (`kda.conv_taps`: with the window's 3 rows in the tiled
        second-minor dimension every program gathering slot rows relaid each conv pool out and
        back). `for_backend`: "token_rows" on TPU, else "default" (where the default is row-major
        already).
    mxfp4_columns: routed experts kept MXFP4 are stored by columns (`quantized.MXFP4Blocks.columns`:
        the input axis second-minor, what the grouped matmul reads), converted at load; else as the
        checkpoint stores them (by rows). Why: stored by rows, the TPU compiler relaid every expert
        code stack out once per prefill call (the real config: 26 of the prefill's 30.6 GiB of
        temporaries, 173 -> 26 GB a call stored by columns; BENCHMARKS.md "A faster host, and what
        the compiled programs copy"). `for_backend`: True on TPU/GPU; CPU keeps rows.
    expert_panels: routed experts held in float32 on one device are stored, when the model is loaded,
        in the native CPU experts kernel's panel order (`ling_jax.expert_panels.PanelOrdered`; D and I
        multiples of 16), which the kernel reads in place: over `[out, in]` rows it packs every weight
        panel in every call (one mid-config MoE layer 0.72-0.95x the time, the same bits; BENCHMARKS.md
        "Thirty-sixth session"). Any other path reads them as rows (a copy). A load-time choice, like
        the layer loop. `for_backend`: True on CPU (where `native_experts` is).
    loop_stack_layouts: weight stacks of the scanned layer loop are stored in the layouts XLA:TPU
        compiles the loop for where those differ from jax's default (`placement.stack_format`): on
        TPU7x the bfloat16 stacks [repeats, n, rows, cols] (the KDA b_proj, the MLA
        kv_a_proj_with_mqa or g_proj the release keeps BF16) in (16, 128) tiles; on every TPU the
        3-dim stacks [repeats, n, cols] (float32 dt_bias and A_log, bfloat16 norm weights)
        row-major and the FP8 block-scale stacks of more than 8 block rows with those rows minor; at
        load and in the compile-only model. Why: placed by default, every scanned engine program
        relaid such stacks out once per call (the real config on TPU7x: 67 MB of 4-dim bf16, 2.8 MB
        of 3-dim and 0.7 MB of scale stacks per device a decode call, BENCHMARKS.md).
        `for_backend`: True on TPU (a layout only; the values are the same).
    """
    kernels: str = "xla"
    experts: str = "auto"
    grouped_matmul: str = "ragged"
    kda_chunk: int = 64
    mla_form: str = "auto"
    layer_loop: str = "scan"
    weights_first_rows: int = 0
    native_experts: bool = False
    native_attention: bool = False
    native_kda: bool = False
    native_linear: bool = False
    attn_block: int = 512
    prefill_chunk: int = 2048
    remat: Optional[str] = None
    platform: Optional[str] = None
    pool_layout: str = "default"
    mxfp4_columns: bool = False
    expert_panels: bool = False
    loop_stack_layouts: bool = False

    def __post_init__(self):
        _choice("kernels", self.kernels, KERNELS)
        _choice("experts", self.experts, EXPERT_PATHS)
        _choice("grouped_matmul", self.grouped_matmul, GROUPED_MATMULS)
        _choice("mla_form", self.mla_form, MLA_FORMS)
        _choice("layer_loop", self.layer_loop, LAYER_LOOPS)
        _choice("pool_layout", self.pool_layout, POOL_LAYOUTS)
        for name, low in (("kda_chunk", 1), ("attn_block", 1), ("prefill_chunk", 1), ("weights_first_rows", 0)):
            check_int(getattr(self, name), f"ExecConfig.{name}", field=name, low=low)
        for name in ("native_experts", "native_attention", "native_kda", "native_linear", "mxfp4_columns",
                     "expert_panels", "loop_stack_layouts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ExecConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.platform is not None:
            _choice("platform", self.platform, PLATFORMS)
        if self.remat is not None:
            if not callable(getattr(jax.checkpoint_policies, str(self.remat), None)):
                raise ValueError(f"ExecConfig.remat must be None or a jax.checkpoint_policies name, "
                                 f"got {self.remat!r}")

    @classmethod
    def for_backend(cls, platform: str | None = None, cfg=None, **overrides) -> "ExecConfig":
        """Defaults for `platform` ("cpu" | "gpu" | "tpu"; None = `jax.default_backend()`) and, when
        given, the model config `cfg` (decides the layer loop). `overrides` replace any field;
        `kernels=None`/`kda_chunk=None`/`layer_loop=None` mean "the default" (handy for CLI flags)."""
        platform = normalize_platform(platform if platform is not None else jax.default_backend())
        accel = platform in ("tpu", "gpu")
        unroll = (cfg is not None and cfg.num_hidden_layers <= UNROLL_MAX_LAYERS
                  and cfg.hidden_size >= UNROLL_MIN_HIDDEN)
        base = dict(kernels="pallas" if accel else "xla",
                    grouped_matmul="ragged" if accel else "capacity",
                    kda_chunk={"tpu": 64, "gpu": GPU_KDA_CHUNK}.get(platform, 16),
                    weights_first_rows=0 if accel else CPU_WEIGHTS_FIRST_ROWS,
                    native_experts=not accel,
                    native_attention=not accel,
                    native_kda=not accel,
                    native_linear=not accel,
                    layer_loop="unroll" if unroll else "scan",
                    pool_layout="token_rows" if platform == "tpu" else "default",
                    mxfp4_columns=accel,
                    expert_panels=not accel,
                    loop_stack_layouts=platform == "tpu",
                    platform=platform)
        base.update({k: v for k, v in overrides.items() if v is not None or k == "remat"})
        if base.get("platform") is not None:
            base["platform"] = normalize_platform(base["platform"])
        return cls(**base)

    def replace(self, **changes) -> "ExecConfig":
        return dataclasses.replace(self, **changes)
