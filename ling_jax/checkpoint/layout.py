"""The tensor inventory of a Ling-3.1-flash release for a given config (spec §12).

`expected_tensors(cfg)` is the single source of tensor names and shapes: the checkpoint writer
generates exactly these, the reader validates against them, and parameter accounting sums them.

Quantization follows one of the two layouts of spec §12.7 (`fp8_layout`, "A" or "B"): every linear
matrix is stored FP8 E4M3 with a `<module>.weight_scale_inv` float32 block-scale grid, except
embeddings, `lm_head`, routers (`mlp.gate.weight`) and exactly one matrix per attention layer,
given by `BF16_MATRICES`:

* Layout B (`DEFAULT_FP8_LAYOUT`): KDA `attention.b_proj` and the MLA head-wise `attention.g_proj`
  (the two 64-row matrices). The spec calls it preferred: it is what the release config's
  `modules_to_not_convert` lists and what both serving engines' loaders build.
* Layout A: KDA `attention.b_proj` and MLA `attention.kv_a_proj_with_mqa`; the head-wise `g_proj`
  is FP8 with a `[1, 32]`-style scale grid (one partial 64-row block row). With FP32 conv taps its
  tensor payload for the real config is the published 573.75 GB (534.35 GiB) total.

The MTP layer's MLA attention follows the same rule; the MTP `eh_proj` is FP8 in both layouts.
`BF16_MATRICES` is the only place the split is defined: the writer, `modules_to_not_convert`
and `ling_jax.accounting` (`ling-jax plan`) all read it through `expected_tensors`. The reader never
uses it: it recognises a quantised tensor by its stored dtype and sibling `weight_scale_inv`.
"""
from __future__ import annotations

import re
from typing import Callable, NamedTuple, Optional

import numpy as np

from ling_jax.checkpoint import mxfp4 as MX
from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK, scale_grid_shape
from ling_jax.config import KDA, MLA, LingConfig

SCALE_SUFFIX = ".weight_scale_inv"

# Storage dtype of the unquantized tensors (safetensors dtype strings). A_log, dt_bias and
# expert_bias are FP32 (spec §12.3/§12.5 [I]). Conv taps: BF16 or FP32 (spec §12.3 [?]); the default
# stays BF16 (what the writer has always written; FP32 is the one the published byte total implies).
PARAM_F32 = ("attention.A_log", "attention.dt_bias", "mlp.gate.expert_bias")
CONV_DTYPES = ("BF16", "F32")
DEFAULT_CONV_DTYPE = "BF16"

# The FP8 layouts of spec §12.7: per attention type, the linear matrices (attention sub-module
# names) stored BF16 instead of FP8. Everything else about the two layouts is identical.
FP8_LAYOUTS = ("A", "B")
BF16_MATRICES = {
    "A": {KDA: ("b_proj",), MLA: ("kv_a_proj_with_mqa",)},
    "B": {KDA: ("b_proj",), MLA: ("g_proj",)},
}
# Layout B stays the default of the writer (and of everything that describes "our" files): the
# spec prefers it and the release config.json's modules_to_not_convert encodes it. Layout A is
# opt-in (`fp8_layout="A"`, `make-checkpoint --fp8-layout A`); `ling-jax plan` defaults to A
# because only A reproduces the published byte total (see `ling_jax.accounting`).
DEFAULT_FP8_LAYOUT = "B"


def check_fp8_layout(fp8_layout) -> str:
    """`fp8_layout` ("A"/"B", any case) normalised, or ValueError."""
    v = str(fp8_layout).upper() if isinstance(fp8_layout, str) else fp8_layout
    if v not in FP8_LAYOUTS:
        raise ValueError(f"unknown fp8 layout {fp8_layout!r} (expected one of: {', '.join(FP8_LAYOUTS)})")
    return v


def check_conv_dtype(conv_dtype) -> str:
    """`conv_dtype` ("BF16"/"F32", any case; "FP32"/"float32"/"bfloat16" accepted) normalised."""
    v = str(conv_dtype).upper() if isinstance(conv_dtype, str) else conv_dtype
    v = {"FP32": "F32", "FLOAT32": "F32", "BFLOAT16": "BF16"}.get(v, v)
    if v not in CONV_DTYPES:
        raise ValueError(f"unknown conv tap dtype {conv_dtype!r} (expected one of: {', '.join(CONV_DTYPES)})")
    return v

# tensor kinds
EMBEDDING = "embedding"   # word embeddings and lm_head (never FP8)
LINEAR = "linear"         # a [out, in] projection matrix (FP8-able)
ROUTER = "router"         # mlp.gate.weight (never FP8)
NORM = "norm"             # 1-D RMSNorm weight
CONV = "conv"             # depthwise conv taps [P, 1, K]
PARAM = "param"           # other 1-D parameters (A_log, dt_bias, expert_bias)


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    #: stored FP8 (+ weight_scale_inv) in the release (under the `fp8_layout` it was built for)
    quantizable: bool
    kind: str = LINEAR
    #: storage dtype when not quantized ("BF16" or "F32")
    dtype: str = "BF16"
    #: decoder layer index (num_hidden_layers for the MTP layer); None for global tensors
    layer: Optional[int] = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def scale_name(weight_name: str) -> str:
    """`a.b.weight` -> `a.b.weight_scale_inv`."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name}: only `.weight` tensors have block scales")
    return weight_name[: -len(".weight")] + SCALE_SUFFIX


def weight_of_scale(name: str) -> Optional[str]:
    """`a.b.weight_scale_inv` -> `a.b.weight`; None if `name` is not a scale name."""
    if name.endswith(SCALE_SUFFIX):
        return name[: -len(SCALE_SUFFIX)] + ".weight"
    return None


# routed experts of any MoE layer, the MTP layer's included (shared experts are not routed)
_ROUTED_EXPERT_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
EXPERT_FORMATS = (None, "mxfp4")


def is_routed_expert_weight(name: str) -> bool:
    """`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` (main and MTP layers)."""
    return _ROUTED_EXPERT_WEIGHT.match(name) is not None


def check_expert_format(experts) -> Optional[str]:
    """None (experts stored like the other matrices) or "mxfp4"; anything else is a ValueError."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"unknown routed-expert format {experts!r} (expected mxfp4 or none)")
    return experts


def module_of(weight_name: str) -> str:
    """`model.layers.4.mlp.gate.weight` -> `model.layers.4.mlp.gate`."""
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def _attention_matrix_setter(p: str, t: dict, layer: int, kind: str, fp8_layout: str):
    """put(n, shape): add the linear `attention.{n}.weight`, FP8 unless `BF16_MATRICES` lists it."""
    bf16 = BF16_MATRICES[fp8_layout][kind]

    def put(n: str, shape) -> None:
        t[p + f"attention.{n}.weight"] = TensorSpec(tuple(shape), n not in bf16, LINEAR, "BF16", layer)
    return put


def _mla(p: str, c: LingConfig, t: dict, layer: int, fp8_layout: str) -> None:
    D, H = c.hidden_size, c.num_attention_heads
    put = _attention_matrix_setter(p, t, layer, MLA, fp8_layout)

    def norm(n: str, width: int) -> None:
        t[p + f"attention.{n}.weight"] = TensorSpec((width,), False, NORM, "BF16", layer)

    if c.q_lora_rank is None:
        put("q_proj", (H * c.qk_head_dim, D))
    else:
        put("q_a_proj", (c.q_lora_rank, D))
        norm("q_a_layernorm", c.q_lora_rank)
        put("q_b_proj", (H * c.qk_head_dim, c.q_lora_rank))
    put("kv_a_proj_with_mqa", (c.kv_lora_rank + c.qk_rope_head_dim, D))
    norm("kv_a_layernorm", c.kv_lora_rank)
    put("kv_b_proj", (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
    put("g_proj", (H, D))  # head-wise gate
    put("dense", (D, H * c.v_head_dim))


def _kda(p: str, c: LingConfig, t: dict, layer: int, conv_dtype: str, fp8_layout: str) -> None:
    D, H, P, K = c.hidden_size, c.num_attention_heads, c.kda_width, c.short_conv_kernel_size
    put = _attention_matrix_setter(p, t, layer, KDA, fp8_layout)

    for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
        put(n, (P, D))
    put("o_proj", (D, P))
    put("b_proj", (H, D))  # beta
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        t[p + f"attention.{n}.weight"] = TensorSpec((P, 1, K), False, CONV, conv_dtype, layer)
    t[p + "attention.A_log"] = TensorSpec((H,), False, PARAM, "F32", layer)
    t[p + "attention.dt_bias"] = TensorSpec((P,), False, PARAM, "F32", layer)
    t[p + "attention.o_norm.weight"] = TensorSpec((c.head_dim,), False, NORM, "BF16", layer)


def _ffn(p: str, c: LingConfig, t: dict, layer: int) -> None:
    D = c.hidden_size
    lin = lambda shape: TensorSpec(tuple(shape), True, LINEAR, "BF16", layer)  # noqa: E731

    def swiglu(q: str, width: int, specs=None):
        up, down = specs or (lin((width, D)), lin((D, width)))
        t[q + "gate_proj.weight"] = up
        t[q + "up_proj.weight"] = up
        t[q + "down_proj.weight"] = down

    if not c.is_moe(layer):
        swiglu(p + "mlp.", c.intermediate_size)
        return
    E = c.num_experts
    t[p + "mlp.gate.weight"] = TensorSpec((E, D), False, ROUTER, "BF16", layer)
    t[p + "mlp.gate.expert_bias"] = TensorSpec((E,), False, PARAM, "F32", layer)
    expert = (lin((c.moe_intermediate_size, D)), lin((D, c.moe_intermediate_size)))  # shared, immutable
    for e in range(E):
        swiglu(p + f"mlp.experts.{e}.", c.moe_intermediate_size, expert)
    shared = c.moe_shared_expert_intermediate_size * c.num_shared_experts
    if shared > 0:
        swiglu(p + "mlp.shared_experts.", shared)


def expected_tensors(cfg: LingConfig, include_mtp: bool = True, conv_dtype: str = DEFAULT_CONV_DTYPE,
                     fp8_layout: str = DEFAULT_FP8_LAYOUT) -> dict[str, TensorSpec]:
    """Every weight tensor of the release for `cfg` (no scale tensors), in file order.

    Order: embeddings, layers 0..N-1, the MTP layer (index N, if `cfg.has_mtp` and
    `include_mtp`), final norm, lm_head. Names and shapes do not depend on `conv_dtype` or
    `fp8_layout`; only `TensorSpec.dtype` (conv taps) and `TensorSpec.quantizable` do.
    """
    conv_dtype = check_conv_dtype(conv_dtype)
    fp8_layout = check_fp8_layout(fp8_layout)
    c = cfg
    D = c.hidden_size
    t: dict[str, TensorSpec] = {}
    t["model.word_embeddings.weight"] = TensorSpec((c.vocab_size, D), False, EMBEDDING, "BF16", None)
    types = c.layer_types
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", i)
        if types[i] == MLA:
            _mla(p, c, t, i, fp8_layout)
        else:
            assert types[i] == KDA
            _kda(p, c, t, i, conv_dtype, fp8_layout)
        t[p + "post_attention_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", i)
        _ffn(p, c, t, i)
    if c.has_mtp and include_mtp:
        n = c.num_hidden_layers
        p = f"model.layers.{n}."
        t[p + "enorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        t[p + "hnorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        t[p + "eh_proj.weight"] = TensorSpec((D, 2 * D), True, LINEAR, "BF16", n)
        t[p + "input_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        _mla(p, c, t, n, fp8_layout)
        t[p + "post_attention_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        _ffn(p, c, t, n)
        t[p + "final_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
    t["model.norm.weight"] = TensorSpec((D,), False, NORM, "BF16", None)
    t["lm_head.weight"] = TensorSpec((c.vocab_size, D), False, EMBEDDING, "BF16", None)
    return t


def release_tensors(cfg: LingConfig, dtype: str = "fp8", include_mtp: bool = True,
                    conv_dtype: str = DEFAULT_CONV_DTYPE, block=None, fp8_layout: str = DEFAULT_FP8_LAYOUT,
                    experts: Optional[str] = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every stored tensor, scales included, in file order.

    dtype='fp8': the matrices quantizable under `fp8_layout` are F8_E4M3, each followed by its F32
    scale grid. dtype='bf16': quantizable matrices are BF16 and there are no scales.
    experts='mxfp4': the routed experts (MTP layer's included) are instead U8 packed E2M1 codes
    `[out, in/2]` followed by their U8 E8M0 `weight_scale_inv` `[out, in/32]` (`checkpoint.mxfp4`).
    """
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"dtype must be 'fp8' or 'bf16', got {dtype!r}")
    mx = check_expert_format(experts) == "mxfp4"
    block = tuple(block or cfg.weight_block_size or DEFAULT_BLOCK)
    out = []
    grids: dict = {}
    fp8 = dtype == "fp8"
    for name, s in expected_tensors(cfg, include_mtp, conv_dtype, fp8_layout).items():
        if mx and is_routed_expert_weight(name):
            out.append((name, MX.PACKED_DTYPE, MX.packed_shape(s.shape, name)))
            out.append((name[:-7] + SCALE_SUFFIX, MX.SCALE_DTYPE, MX.scale_shape(s.shape, name)))
        elif s.quantizable and fp8:
            g = grids.get(s.shape)
            if g is None:
                g = grids[s.shape] = scale_grid_shape(s.shape, block)
            out.append((name, "F8_E4M3", s.shape))
            out.append((name[:-7] + SCALE_SUFFIX, "F32", g))  # name ends with ".weight"
        else:
            out.append((name, s.dtype, s.shape))
    return out


def modules_to_not_convert(cfg: LingConfig, include_mtp: bool = True,
                           fp8_layout: str = DEFAULT_FP8_LAYOUT) -> list[str]:
    """The `quantization_config.modules_to_not_convert` list of `fp8_layout`, in the release's order:
    lm_head, embeddings, routers (MoE layers incl. MTP), then the BF16 matrices of `BF16_MATRICES`:
    KDA `b_proj`, then MLA (incl. MTP) `g_proj` (layout B, the release config's list) or
    `kv_a_proj_with_mqa` (layout A)."""
    fp8_layout = check_fp8_layout(fp8_layout)
    n = cfg.num_hidden_layers + (1 if cfg.has_mtp and include_mtp else 0)
    types = list(cfg.layer_types) + [MLA] * (n - cfg.num_hidden_layers)
    out = ["lm_head", "model.word_embeddings"]
    out += [f"model.layers.{i}.mlp.gate" for i in range(n) if cfg.is_moe(i)]
    for kind in (KDA, MLA):
        for m in BF16_MATRICES[fp8_layout][kind]:
            out += [f"model.layers.{i}.attention.{m}" for i in range(n) if types[i] == kind]
    return out


def quantization_config(cfg: LingConfig, include_mtp: bool = True, fp8_layout: str = DEFAULT_FP8_LAYOUT) -> dict:
    """The release's `quantization_config` (fp8, e4m3, dynamic activations, 128×128 blocks)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(cfg.weight_block_size or DEFAULT_BLOCK),
        "modules_to_not_convert": modules_to_not_convert(cfg, include_mtp, fp8_layout),
    }


def mxfp4_quantization_config(cfg: LingConfig, base: Optional[dict], include_mtp: bool = True) -> dict:
    """The `quantization_config` of a checkpoint with MXFP4 routed experts (Ling's recipe).

    `base`: the fp8 `quantization_config` the other tensors follow (kept as is: those tensors are
    unchanged), or None when they are BF16. Then every module with a stored matrix except the routed
    experts is listed in `modules_to_not_convert`, so an fp8-recipe loader keeps them unquantised.
    Adds `routed_experts_quant_method: mxfp4`, `routed_experts_group_size: 32`; no `scale_fmt`
    (see `checkpoint.mxfp4`: in vLLM it would declare the dense FP8 scales powers of two).
    """
    if base is not None:
        q = {k: v for k, v in base.items() if k not in MX.CONFIG_KEYS}
    else:
        mods = [module_of(n) for n, s in expected_tensors(cfg, include_mtp).items()
                if s.kind in (LINEAR, EMBEDDING, ROUTER) and not is_routed_expert_weight(n)]
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": list(cfg.weight_block_size or DEFAULT_BLOCK),
             "modules_to_not_convert": list(dict.fromkeys(mods))}
    q.update(MX.CONFIG_KEYS)
    return q


def count_params(cfg: LingConfig, include_mtp: bool = True) -> int:
    """Number of model parameters (scales excluded)."""
    return sum(s.numel for s in expected_tensors(cfg, include_mtp).values())


# ---------------------------------------------------------------------------------------------
# model parameter paths <-> checkpoint tensor names (the one place that maps them)
# ---------------------------------------------------------------------------------------------
# The NNX module tree mirrors the checkpoint names, so the mapping is a path join plus three
# structural differences: routed experts are stacked `[E, out, in]` (one parameter, E tensors),
# conv taps drop their middle axis (`[P,1,K]` -> `[P,K]`), and the MTP layer
# (`model.layers.{N}.*`) lives under `mtp` with its attention/MLP block under `mtp.block`.
EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
CONV_TAPS = ("q_conv1d", "k_conv1d", "v_conv1d")


def canonical_path(path) -> tuple:
    """The per-layer parameter path checkpoints are named by (`model/layers/{i}/...`) of a path of
    a model whose layers are stored one module per layer (`model/layers/per_layer/{i}/...`, see
    `ling_jax.layer_stack.LayerStack`); other paths unchanged. A path into a stacked run
    (`model/layers/runs/...`) names many layers: `layer_stack.stacked_layer_paths` expands it."""
    p = tuple(path)
    if len(p) > 3 and str(p[0]) == "model" and str(p[1]) == "layers" and str(p[2]) == "per_layer":
        return p[:2] + p[3:]
    return p


def is_expert_path(path) -> bool:
    """A stacked routed-expert projection (`.../mlp/experts/gate_proj`)."""
    p = [str(x) for x in path]
    return len(p) >= 2 and p[-2] == "experts" and p[-1] in EXPERT_PROJ


def checkpoint_names(path: tuple, cfg: LingConfig) -> tuple[str, list[str], Callable]:
    """For an NNX parameter path of one layer (or a global): (display name, checkpoint tensor names,
    assemble(arrays) -> array)."""
    p = [str(x) for x in canonical_path(path)]
    if p[0] == "mtp":
        rest = p[2:] if p[1] == "block" else p[1:]
        p = ["model", "layers", str(cfg.num_hidden_layers)] + rest
    name = ".".join(p)
    if is_expert_path(path):
        prefix = ".".join(p[:-1])
        names = [f"{prefix}.{e}.{p[-1]}.weight" for e in range(cfg.num_experts)]
        return name, names, lambda arrs: np.stack(arrs)
    if p[-1] in CONV_TAPS:
        return name, [name + ".weight"], lambda arrs: arrs[0].reshape(arrs[0].shape[0], -1)
    if p[-1] == "o_norm":
        return name, [name + ".weight"], lambda arrs: arrs[0]
    return name, [name], lambda arrs: arrs[0]
