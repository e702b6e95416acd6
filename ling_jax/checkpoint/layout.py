"""The tensor inventory of a Ling-3.1-flash release for a given config (spec §12).

`expected_tensors(cfg)` is the single source of tensor names and shapes: the checkpoint writer
generates exactly these, the reader validates against them, and parameter accounting sums them.

Quantization follows the preferred "Layout B" of spec §12.7: every linear matrix is stored FP8
E4M3 with a `<module>.weight_scale_inv` float32 block-scale grid, except embeddings, `lm_head`,
routers (`mlp.gate.weight`), KDA `attention.b_proj` and the MLA head-wise `attention.g_proj`
(both 64-row matrices). The MTP `eh_proj` is FP8.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK, scale_grid_shape
from ling_jax.config import KDA, MLA, LingConfig

SCALE_SUFFIX = ".weight_scale_inv"

# Storage dtype of the unquantized tensors (safetensors dtype strings). A_log, dt_bias and
# expert_bias are FP32 (spec §12.3/§12.5 [I]); conv taps are BF16 here (spec: BF16 or FP32 [?]).
PARAM_F32 = ("attention.A_log", "attention.dt_bias", "mlp.gate.expert_bias")
DEFAULT_CONV_DTYPE = "BF16"

# tensor kinds
EMBEDDING = "embedding"   # word embeddings and lm_head (never FP8)
LINEAR = "linear"         # a [out, in] projection matrix (FP8-able)
ROUTER = "router"         # mlp.gate.weight (never FP8)
NORM = "norm"             # 1-D RMSNorm weight
CONV = "conv"             # depthwise conv taps [P, 1, K]
PARAM = "param"           # other 1-D parameters (A_log, dt_bias, expert_bias)


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    #: stored FP8 (+ weight_scale_inv) in the release (Layout B)
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


def module_of(weight_name: str) -> str:
    """`model.layers.4.mlp.gate.weight` -> `model.layers.4.mlp.gate`."""
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def _mla(p: str, c: LingConfig, t: dict, layer: int) -> None:
    D, H = c.hidden_size, c.num_attention_heads
    lin = lambda shape, q=True: TensorSpec(tuple(shape), q, LINEAR, "BF16", layer)  # noqa: E731
    if c.q_lora_rank is None:
        t[p + "attention.q_proj.weight"] = lin((H * c.qk_head_dim, D))
    else:
        t[p + "attention.q_a_proj.weight"] = lin((c.q_lora_rank, D))
        t[p + "attention.q_a_layernorm.weight"] = TensorSpec((c.q_lora_rank,), False, NORM, "BF16", layer)
        t[p + "attention.q_b_proj.weight"] = lin((H * c.qk_head_dim, c.q_lora_rank))
    t[p + "attention.kv_a_proj_with_mqa.weight"] = lin((c.kv_lora_rank + c.qk_rope_head_dim, D))
    t[p + "attention.kv_a_layernorm.weight"] = TensorSpec((c.kv_lora_rank,), False, NORM, "BF16", layer)
    t[p + "attention.kv_b_proj.weight"] = lin((H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
    t[p + "attention.g_proj.weight"] = lin((H, D), q=False)  # head-wise gate: BF16 (Layout B)
    t[p + "attention.dense.weight"] = lin((D, H * c.v_head_dim))


def _kda(p: str, c: LingConfig, t: dict, layer: int, conv_dtype: str) -> None:
    D, H, P, K = c.hidden_size, c.num_attention_heads, c.kda_width, c.short_conv_kernel_size
    lin = lambda shape, q=True: TensorSpec(tuple(shape), q, LINEAR, "BF16", layer)  # noqa: E731
    for n in ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj"):
        t[p + f"attention.{n}.weight"] = lin((P, D))
    t[p + "attention.o_proj.weight"] = lin((D, P))
    t[p + "attention.b_proj.weight"] = lin((H, D), q=False)  # beta: BF16 (Layout B)
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


def expected_tensors(cfg: LingConfig, include_mtp: bool = True,
                     conv_dtype: str = DEFAULT_CONV_DTYPE) -> dict[str, TensorSpec]:
    """Every weight tensor of the release for `cfg` (no scale tensors), in file order.

    Order: embeddings, layers 0..N-1, the MTP layer (index N, if `cfg.has_mtp` and
    `include_mtp`), final norm, lm_head.
    """
    c = cfg
    D = c.hidden_size
    t: dict[str, TensorSpec] = {}
    t["model.word_embeddings.weight"] = TensorSpec((c.vocab_size, D), False, EMBEDDING, "BF16", None)
    types = c.layer_types
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", i)
        if types[i] == MLA:
            _mla(p, c, t, i)
        else:
            assert types[i] == KDA
            _kda(p, c, t, i, conv_dtype)
        t[p + "post_attention_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", i)
        _ffn(p, c, t, i)
    if c.has_mtp and include_mtp:
        n = c.num_hidden_layers
        p = f"model.layers.{n}."
        t[p + "enorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        t[p + "hnorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        t[p + "eh_proj.weight"] = TensorSpec((D, 2 * D), True, LINEAR, "BF16", n)
        t[p + "input_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        _mla(p, c, t, n)
        t[p + "post_attention_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
        _ffn(p, c, t, n)
        t[p + "final_layernorm.weight"] = TensorSpec((D,), False, NORM, "BF16", n)
    t["model.norm.weight"] = TensorSpec((D,), False, NORM, "BF16", None)
    t["lm_head.weight"] = TensorSpec((c.vocab_size, D), False, EMBEDDING, "BF16", None)
    return t


def release_tensors(cfg: LingConfig, dtype: str = "fp8", include_mtp: bool = True,
                    conv_dtype: str = DEFAULT_CONV_DTYPE, block=None) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every stored tensor, scales included, in file order.

    dtype='fp8': quantizable matrices are F8_E4M3, each followed by its F32 scale grid.
    dtype='bf16': quantizable matrices are BF16 and there are no scales.
    """
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"dtype must be 'fp8' or 'bf16', got {dtype!r}")
    block = tuple(block or cfg.weight_block_size or DEFAULT_BLOCK)
    out = []
    grids: dict = {}
    fp8 = dtype == "fp8"
    for name, s in expected_tensors(cfg, include_mtp, conv_dtype).items():
        if s.quantizable and fp8:
            g = grids.get(s.shape)
            if g is None:
                g = grids[s.shape] = scale_grid_shape(s.shape, block)
            out.append((name, "F8_E4M3", s.shape))
            out.append((name[:-7] + SCALE_SUFFIX, "F32", g))  # name ends with ".weight"
        else:
            out.append((name, s.dtype, s.shape))
    return out


def modules_to_not_convert(cfg: LingConfig, include_mtp: bool = True) -> list[str]:
    """The `quantization_config.modules_to_not_convert` list of Layout B, in the release's order:
    lm_head, embeddings, routers (MoE layers incl. MTP), KDA b_proj, MLA head-wise g_proj."""
    n = cfg.num_hidden_layers + (1 if cfg.has_mtp and include_mtp else 0)
    types = list(cfg.layer_types) + [MLA] * (n - cfg.num_hidden_layers)
    out = ["lm_head", "model.word_embeddings"]
    out += [f"model.layers.{i}.mlp.gate" for i in range(n) if cfg.is_moe(i)]
    out += [f"model.layers.{i}.attention.b_proj" for i in range(n) if types[i] == KDA]
    out += [f"model.layers.{i}.attention.g_proj" for i in range(n) if types[i] == MLA]
    return out


def quantization_config(cfg: LingConfig, include_mtp: bool = True) -> dict:
    """The release's `quantization_config` (fp8, e4m3, dynamic activations, 128×128 blocks)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(cfg.weight_block_size or DEFAULT_BLOCK),
        "modules_to_not_convert": modules_to_not_convert(cfg, include_mtp),
    }


def count_params(cfg: LingConfig, include_mtp: bool = True) -> int:
    """Number of model parameters (scales excluded)."""
    return sum(s.numel for s in expected_tensors(cfg, include_mtp).values())
