"""MXFP4 (OCP Microscaling Formats v1.0, "MXFP4") codec for the routed experts.

Format (OCP MX v1.0 §5, §6.3): a weight `W [..., K]` is cut into blocks of `GROUP = 32` consecutive
elements along its LAST (input) dimension. Each block shares one E8M0 scale `X = 2^(e - 127)`
(`e` the stored byte, 0..254; `e = 0xFF` is NaN) and stores 32 E2M1 elements (1 sign, 2 exponent,
1 mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}, code = sign << 3 | magnitude index):

    W[..., 32 b + j] = E2M1(code[..., 32 b + j]) * 2^(scale[..., b] - 127)

On disk (what this module writes, and what it reads):

================================  ======  ======================  ============================
tensor                            dtype   shape                   content
================================  ======  ======================  ============================
``<module>.weight``               U8      ``[out, in / 2]``       two E2M1 codes per byte:
                                                                  element 2j in the LOW nibble,
                                                                  element 2j+1 in the HIGH one
``<module>.weight_scale_inv``     U8      ``[out, in / 32]``      E8M0 exponent bytes, row-major,
                                                                  block b of row r at [r, b]
================================  ======  ======================  ============================

`F8_E8M0` is accepted for the scale on read (same bytes). config.json's `quantization_config`
keeps the release's fp8 recipe for everything else and adds
``routed_experts_quant_method: "mxfp4"`` and ``routed_experts_group_size: 32``.

Where this comes from (read, not copied; 2026-12-01, through the code search index):

* vLLM ``vllm/model_executor/models/bailing_moe_v3.py`` (vllm-project/vllm):
  ``_configure_ling_fp8_quant_config`` reads ``quantization_config.routed_experts_quant_method``
  (only ``"mxfp4"`` accepted, anything else raises) and sets the Fp8Config's ``store_dtype =
  "mxfp4"``; ``scale_fmt == "ue8m0"`` sets ``is_scale_e8m0``. ``_LING_MXFP4_WEIGHTS_MAPPER`` renames
  ``.mlp.experts.<e>.(gate|up|down)_proj.weight_scale_inv`` to ``...weight_scale`` -- so Ling's
  checkpoints name the E8M0 scale ``weight_scale_inv`` and the packed codes ``weight``.
* vLLM ``vllm/model_executor/layers/quantization/fp8.py``: with ``store_dtype == "mxfp4"`` the
  routed experts get ``Mxfp4MoEMethod`` (``vllm/model_executor/layers/quantization/mxfp4.py``),
  whose ``create_weights`` makes ``w13_weight`` uint8 ``[E, 2 I, H // 2]``, ``w13_weight_scale``
  uint8 ``[E, 2 I, H // 32]`` (``mxfp4_block = 32``) and likewise ``w2`` ``[E, H, I // 2]`` /
  ``[E, H, I // 32]``: per expert exactly ``[out, in/2]`` codes and ``[out, in/32]`` scales, both
  uint8 (it notes torch float4_e2m1fn_x2 / float8_e8m0fnu are not used yet). We therefore store
  both as U8: a loader that copies an F8_E8M0 tensor into a uint8 parameter would convert values,
  not bytes.
* A vLLM test of the Ling quant config (``_LING_MXFP4_QUANT_CONFIG``, test of
  ``bailing_moe_v3``/``bailing_moe_v3_vl``; found by exact string, path not pinned) spells the
  Ling-3.0-flash-fp4 recipe: ``quant_method fp8, fmt e4m3, activation_scheme dynamic,
  weight_block_size [128, 128], scale_fmt ue8m0, modules_to_not_convert [...],
  routed_experts_quant_method mxfp4, routed_experts_group_size 32``. The checkpoint itself
  (inclusionAI/Ling-3.0-flash-fp4) is not in the index: its stored dtypes could not be read.
* SGLang ``python/sglang/srt/models/bailing_moe_v3.py`` (sgl-project/sglang) loads the experts
  through ``FusedMoE.make_expert_params_mapping`` with the checkpoint names unchanged (so
  ``weight_scale_inv``), and turns off shared-expert fusion when ``quant_config.is_fp4_experts``
  (set from ``routed_experts_quant_method``). Its ``layers/quantization/mxfp4_tensor.py``
  (``MXFP4QuantizeUtil``, from NVIDIA ModelOpt) fixes the nibble order -- even index in the low
  nibble, odd in the high -- the code layout (bit 3 sign, bits 0-2 index into
  [0, .5, 1, 1.5, 2, 3, 4, 6]), the scale 2^(e - 127) and the row-major [rows, K/32] scale layout.

Where the sources disagree with the spec, and what we do:

* Scale choice. OCP v1.0 (and the issue) take ``X = 2^(floor(log2(amax)) - emax_elem)`` with
  ``emax_elem = 2`` for E2M1, so ``amax / X`` is in [4, 8) and elements above 6·X saturate to ±6.
  ModelOpt/SGLang's quantiser uses ``ceil(log2(amax / 6))`` (never saturates, coarser grid for
  blocks whose amax is just above a power of two). We follow the spec.
* Rounding. OCP: round-to-nearest, ties to even, saturating. ModelOpt counts bounds with a strict
  ``>`` (ties toward zero: 0.75 -> 0.5). We round ties to even (0.75 -> 1, 1.25 -> 1, 2.5 -> 2,
  5 -> 4), via ``ml_dtypes.float4_e2m1fn`` after an explicit clip to ±6.
* ``scale_fmt: ue8m0``: in vLLM it makes the *dense* FP8 block-scale parameters
  float8_e8m0fnu (``is_scale_e8m0``), i.e. it claims the 128×128 scales are powers of two. Our
  dense FP8 tensors are the release's (float32 amax/448 scales, copied byte for byte), so we do
  NOT write ``scale_fmt``; the MXFP4 scales are E8M0 by definition of the format.

Our rules where the spec leaves a choice:

* All-zero blocks (amax = 0, -0 included) get scale byte 0 (2^-127, the smallest scale, as
  ModelOpt's clamp at -127 also gives) and codes 0/8, so they decode to ±0 exactly.
* The scale exponent is clamped to E8M0's range: blocks with amax < 2^-124 (subnormal float32
  included) use 2^-127; nothing else reaches the clamp.
* Signs are kept: -0.0 and negatives that round to zero get code 8 (decodes to -0.0).
* ``in`` must be a multiple of 32 (refused otherwise, naming the tensor): vLLM's shapes floor
  ``H // 32`` and would drop a partial block, so a padded format would not load there. The real
  config (4096, 1280) and the test configs satisfy it.
* Non-finite inputs are refused. Stored scale 0xFF (NaN) is refused on read with the tensor name.
  Scale bytes 253/254 can make large codes exceed float32 (decode gives ±inf); the encoder of
  finite float32 data never writes a byte above 252.

Host side (NumPy, streaming over row chunks so temporaries stay bounded): `quantize_mxfp4`,
`dequantize_mxfp4`. Device side (jax.numpy, jit-able, for unpacking inside the expert matmul):
`dequantize_mxfp4_jax`, built from integer bit operations so it is bit-exact with the NumPy decode
even where XLA flushes float32 subnormals to zero in multiplications.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from ling_jax.checkpoint.safetensors_io import CheckpointError

GROUP = 32                 # elements per E8M0 scale (routed_experts_group_size)
E2M1_MAX = 6.0             # largest E2M1 magnitude
E2M1_EMAX = 2              # exponent of the largest E2M1 power of two (4 = 2^2)
E8M0_BIAS = 127
E8M0_NAN = 0xFF
PACKED_DTYPE = "U8"        # safetensors dtype of the packed codes
SCALE_DTYPE = "U8"         # safetensors dtype we write for the scales
SCALE_DTYPES = ("U8", "F8_E8M0")  # accepted on read (same bytes)
QUANT_METHOD = "mxfp4"
CONFIG_KEYS = {"routed_experts_quant_method": QUANT_METHOD, "routed_experts_group_size": GROUP}

# value of each 4-bit code (index = code): + magnitudes, then the same with the sign bit
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
ROW_CHUNK_ELEMENTS = 1 << 22  # ~4M elements (16 MiB of float32) per quantisation chunk
_FP4 = np.dtype(ml_dtypes.float4_e2m1fn)


# ---------------------------------------------------------------------------------------------
# shapes and validation
# ---------------------------------------------------------------------------------------------
def _check_width(k: int, name: str) -> None:
    if k % GROUP:
        raise CheckpointError(f"{name}: input width {k} is not a multiple of the MXFP4 block {GROUP} "
                              f"(partial blocks are not supported)")


def packed_shape(shape: Sequence[int], name: str = "tensor") -> tuple[int, ...]:
    """`[..., K]` -> `[..., K / 2]` (two codes per byte). K must be a multiple of 32."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise CheckpointError(f"{name}: a scalar cannot be MXFP4-quantised")
    _check_width(shape[-1], name)
    return shape[:-1] + (shape[-1] // 2,)


def scale_shape(shape: Sequence[int], name: str = "tensor") -> tuple[int, ...]:
    """`[..., K]` -> `[..., K / 32]` (one E8M0 byte per block)."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise CheckpointError(f"{name}: a scalar cannot be MXFP4-quantised")
    _check_width(shape[-1], name)
    return shape[:-1] + (shape[-1] // GROUP,)


def mxfp4_problems(name: str, packed: tuple, packed_dtype: str, scale_name: str, scale: Optional[tuple],
                   scale_dtype: Optional[str], logical: Optional[Sequence[int]] = None) -> list[str]:
    """Header-level disagreements of an MXFP4 pair (shapes and dtypes only; no data read).

    `packed`/`scale` are the stored shapes (`scale` None: the scale tensor is missing),
    `logical` the `[..., K]` shape the config implies (None: only internal consistency).
    """
    out: list[str] = []
    packed = tuple(packed)
    if packed_dtype != PACKED_DTYPE:
        out.append(f"{name}: MXFP4 codes stored {packed_dtype}, expected {PACKED_DTYPE}")
    if not packed:
        out.append(f"{name}: MXFP4 codes must have at least one dimension")
        return out
    width = packed[-1]
    if width % 2:
        out.append(f"{name}: packed MXFP4 width {width} is odd (two codes per byte and 32-element blocks "
                   f"need a multiple of {GROUP // 2})")
    elif width % (GROUP // 2):
        out.append(f"{name}: packed MXFP4 width {width} is not a multiple of {GROUP // 2} "
                   f"(input width {2 * width} is not a multiple of the block {GROUP})")
    if logical is not None:
        logical = tuple(int(s) for s in logical)
        want = logical[:-1] + (logical[-1] // 2,)
        if logical[-1] % GROUP:
            out.append(f"{name}: input width {logical[-1]} of {list(logical)} is not a multiple of the MXFP4 "
                       f"block {GROUP}")
        elif packed != want:
            out.append(f"{name}: packed MXFP4 shape {list(packed)}, expected {list(want)} (config shape "
                       f"{list(logical)}, two codes per byte)")
    if scale is None:
        out.append(f"{name}: MXFP4 codes without their scale tensor {scale_name!r}")
        return out
    scale = tuple(scale)
    if scale_dtype not in SCALE_DTYPES:
        out.append(f"{scale_name}: MXFP4 scale stored {scale_dtype}, expected one of {list(SCALE_DTYPES)}")
    want_s = packed[:-1] + (2 * width // GROUP,) if logical is None else \
        tuple(int(s) for s in logical[:-1]) + (int(logical[-1]) // GROUP,)
    if scale != want_s:
        out.append(f"{scale_name}: MXFP4 scale shape {list(scale)}, expected {list(want_s)} (one E8M0 byte per "
                   f"{GROUP} inputs of {name!r})")
    return out


def check_scale_bytes(scales: np.ndarray, name: str) -> None:
    """Refuse NaN scales (byte 0xFF), naming the tensor and the first offending position."""
    s = np.asarray(scales)
    bad = s.view(np.uint8) == E8M0_NAN if s.dtype != np.uint8 else s == E8M0_NAN
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise CheckpointError(f"{name}: {int(bad.sum())} MXFP4 scale byte(s) are 0xFF (E8M0 NaN), first at "
                              f"{list(first)}")


def _as_u8(a: np.ndarray, what: str, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.dtype(ml_dtypes.float8_e8m0fnu):
        return a.view(np.uint8)
    raise CheckpointError(f"{name}: MXFP4 {what} must be uint8, got {a.dtype}")


# ---------------------------------------------------------------------------------------------
# NumPy: encode
# ---------------------------------------------------------------------------------------------
def _quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[R, K] float32 (K % 32 == 0, finite) -> (packed uint8 [R, K/2], scales uint8 [R, K/32])."""
    r, k = x.shape
    blocks = x.reshape(r, k // GROUP, GROUP)
    amax = np.abs(blocks).max(axis=-1)                       # [R, K/32]
    _, ex = np.frexp(amax)                                   # amax = m * 2^ex, m in [0.5, 1): floor(log2) = ex - 1
    e = np.where(amax > 0, ex.astype(np.int32) - 1 - E2M1_EMAX, -E8M0_BIAS)
    e = np.clip(e, -E8M0_BIAS, E8M0_BIAS)                    # E8M0 holds 2^-127 .. 2^127
    # exact power-of-two rescale (ldexp never rounds a float32 here: |x / 2^e| < 8)
    y = np.ldexp(blocks, (-e)[..., None].astype(np.int32))
    np.clip(y, -E2M1_MAX, E2M1_MAX, out=y)                   # saturate (values in (6, 8) -> 6)
    codes = y.astype(_FP4).view(np.uint8).reshape(r, k)      # round to nearest, ties to even
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, (e + E8M0_BIAS).astype(np.uint8)


def quantize_mxfp4(w: np.ndarray, name: str = "tensor", rows_per_chunk: Optional[int] = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4-encode `w [..., K]` (K a multiple of 32) along its last axis.

    Returns (packed uint8 `[..., K/2]`, scales uint8 `[..., K/32]`). Works over chunks of rows
    (`rows_per_chunk`, default ~4M elements), so the float temporaries stay bounded whatever the
    tensor size. Non-finite values are refused, naming `name`.
    """
    w = np.asarray(w)
    pshape, sshape = packed_shape(w.shape, name), scale_shape(w.shape, name)
    k = w.shape[-1]
    rows = math.prod(w.shape[:-1])
    flat = w.reshape(rows, k)
    per = rows_per_chunk or max(1, ROW_CHUNK_ELEMENTS // max(k, 1))
    packed = np.empty((rows, k // 2), np.uint8)
    scales = np.empty((rows, k // GROUP), np.uint8)
    for r0 in range(0, rows, per):
        x = np.asarray(flat[r0:r0 + per], np.float32)
        if not np.isfinite(x).all():
            bad = np.argwhere(~np.isfinite(x))[0]
            raise CheckpointError(f"{name}: cannot MXFP4-quantise a non-finite value (row {r0 + int(bad[0])}, "
                                  f"column {int(bad[1])})")
        packed[r0:r0 + per], scales[r0:r0 + per] = _quantize_rows(x)
    return packed.reshape(pshape), scales.reshape(sshape)


# ---------------------------------------------------------------------------------------------
# NumPy: decode
# ---------------------------------------------------------------------------------------------
def unpack_codes(packed: np.ndarray) -> np.ndarray:
    """uint8 `[..., P]` -> 4-bit codes uint8 `[..., 2P]` (low nibble first)."""
    p = np.asarray(packed)
    out = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
    out[..., 0::2] = p & 0x0F
    out[..., 1::2] = p >> 4
    return out


def dequantize_mxfp4(packed: np.ndarray, scales: np.ndarray, name: str = "tensor",
                     scale_name: Optional[str] = None, dtype=np.float32,
                     rows_per_chunk: Optional[int] = None) -> np.ndarray:
    """Decode MXFP4 `packed [..., K/2]` + `scales [..., K/32]` to `[..., K]` (float32, exact).

    Validates the pair first (odd / non-block packed width, scale shape, NaN scale bytes) and
    names `name` (or `scale_name`, for the scale) in the error. The float32 values are exact (subnormals included: ldexp, not a
    flushing multiply), then cast to `dtype`.
    """
    packed = _as_u8(packed, "codes", name)
    scales = _as_u8(scales, "scales", name)
    scale_name = scale_name or f"scale of {name}"
    probs = mxfp4_problems(name, packed.shape, PACKED_DTYPE, scale_name, scales.shape, SCALE_DTYPE)
    if probs:
        raise CheckpointError(probs[0])
    check_scale_bytes(scales, scale_name)
    p = packed.shape[-1]
    rows = math.prod(packed.shape[:-1])
    flat_p = packed.reshape(rows, p)
    flat_s = scales.reshape(rows, 2 * p // GROUP)
    out = np.empty((rows, 2 * p), np.dtype(dtype))
    per = rows_per_chunk or max(1, ROW_CHUNK_ELEMENTS // max(2 * p, 1))
    for r0 in range(0, rows, per):
        codes = unpack_codes(flat_p[r0:r0 + per])
        vals = E2M1_VALUES[codes].reshape(codes.shape[0], -1, GROUP)
        e = flat_s[r0:r0 + per].astype(np.int32) - E8M0_BIAS
        with np.errstate(over="ignore"):  # scale bytes 253/254 with large codes: +-inf, as the math says
            out[r0:r0 + per] = np.ldexp(vals, e[..., None]).reshape(codes.shape[0], -1)
    return out.reshape(packed.shape[:-1] + (2 * p,))


# ---------------------------------------------------------------------------------------------
# JAX: decode (inside jit, e.g. in the expert matmul)
# ---------------------------------------------------------------------------------------------
# E2M1 magnitude index -> (float32 bit pattern of 2 * |value|, i.e. of the integer n in
# {0, 1, 2, 3, 4, 6, 8, 12}); |value| = n * 2^-1, so |W| = n * 2^(e - 128).
_N_OF_INDEX = np.array([0, 1, 2, 3, 4, 6, 8, 12], np.int32)


def _e2m1_times_scale(codes, e, dtype):
    """float32 of the E2M1 `codes` (int32, 0..15) times 2^(e - 127) (`e` int32, broadcast against
    codes), by integer operations on the bits (see `dequantize_mxfp4_jax`), then `dtype` (None: f32)."""
    # jax is imported here, not at module level, so the host-only users of this module (layout,
    # `ling-jax plan` / `inspect` / `quantize`) do not pay for importing it
    import jax
    import jax.numpy as jnp

    idx = codes & 0x7
    # n = _N_OF_INDEX[idx] computed, not looked up: a table lookup is a gather, which XLA does not
    # fuse with the elementwise rest, so it materialised an int32 copy of every decoded expert weight
    e2, m = idx >> 1, idx & 1
    n = jnp.where(e2 == 0, m, (2 + m) << jnp.maximum(e2 - 1, 0))
    nbits = jax.lax.bitcast_convert_type(n.astype(jnp.float32), jnp.int32)
    exp_field = (nbits >> 23) + e - 128                          # biased exponent of the result
    normal = nbits + ((e - 128) << 23)
    sub = n << jnp.clip(e + 21, 0, 30)                           # only used where exp_field <= 0 (e <= 1)
    mag = jnp.where(exp_field >= 1, normal, sub)
    mag = jnp.where(exp_field >= 255, 0x7F800000, mag)
    mag = jnp.where(n == 0, 0, mag)
    mag = jnp.where(e == E8M0_NAN, 0x7FC00000, mag)
    out = jax.lax.bitcast_convert_type(mag | ((codes >> 3) << 31), jnp.float32)
    return out if dtype is None else out.astype(dtype)


def dequantize_mxfp4_jax(packed, scales, dtype=None):
    """jax.numpy decode of `packed [..., K/2]` uint8 + `scales [..., K/32]` uint8 -> `[..., K]`.

    Bit-exact with `dequantize_mxfp4` in float32: the result's bits are assembled with integer
    operations (normal results: the float32 bits of n plus (e - 128) in the exponent field;
    results below 2^-126: the subnormal significand n · 2^(e + 21) directly; exponent overflow:
    ±inf; scale 0xFF: NaN). No multiplication, so XLA's flush-to-zero cannot change a value.
    Shapes must be static (they are under jit); validation of shapes is done here, NaN bytes are
    the host's job (`check_scale_bytes`) since a traced value cannot raise. `dtype`: output dtype
    (default float32; bfloat16 is exact for every normal result).
    """
    import jax.numpy as jnp

    if packed.ndim == 0 or scales.shape != packed.shape[:-1] + (2 * packed.shape[-1] // GROUP,) \
            or packed.shape[-1] % (GROUP // 2):
        raise ValueError(f"dequantize_mxfp4_jax: packed {tuple(packed.shape)} and scales "
                         f"{tuple(scales.shape)} are not an MXFP4 pair (packed [..., K/2], scales [..., K/32], "
                         f"K a multiple of {GROUP})")
    lead = packed.shape[:-1]
    k = 2 * packed.shape[-1]
    p = packed.astype(jnp.int32).reshape(lead + (k // GROUP, GROUP // 2))  # 16 bytes = one 32-group
    e = scales.astype(jnp.int32)[..., None]                          # [..., K/32, 1]
    # low nibble = even element, high = odd: both decoded elementwise from the packed bytes and
    # interleaved last, so XLA fuses the whole decode into the one array it returns
    return jnp.stack([_e2m1_times_scale(p & 0x0F, e, dtype), _e2m1_times_scale(p >> 4, e, dtype)],
                     axis=-1).reshape(lead + (k,))


def dequantize_mxfp4_columns(packed, scales, dtype=None):
    """The even and the odd inputs of an MXFP4 weight stored by columns: `packed [..., K/2, N]` uint8
    (byte (m, n) = inputs 2m (low nibble) and 2m+1 (high) of output n), `scales [..., K/32, N]` ->
    (even, odd), each `[..., K/2, N]` (rows 2m and 2m+1 of the weight transposed), bit-exact with
    `dequantize_mxfp4_jax` of the row-stored weight. Why: a matmul contracts K, and on TPU it reads the
    contracted axis second-minor; stored by rows the codes were relaid out to that, the whole expert
    stack once per call (BENCHMARKS.md "A faster host, and what the compiled programs copy"), and
    decoding the two nibbles apart needs no interleave: y = x_even · even + x_odd · odd."""
    import jax.numpy as jnp

    if packed.ndim < 2 or scales.shape != packed.shape[:-2] + (2 * packed.shape[-2] // GROUP, packed.shape[-1]) \
            or packed.shape[-2] % (GROUP // 2):
        raise ValueError(f"dequantize_mxfp4_columns: packed {tuple(packed.shape)} and scales "
                         f"{tuple(scales.shape)} are not an MXFP4 pair by columns (packed [..., K/2, N], "
                         f"scales [..., K/32, N], K a multiple of {GROUP})")
    lead, (k2, n) = packed.shape[:-2], packed.shape[-2:]
    p = packed.astype(jnp.int32).reshape(lead + (k2 // (GROUP // 2), GROUP // 2, n))
    e = scales.astype(jnp.int32)[..., None, :]                        # [..., K/32, 1, N]
    return tuple(_e2m1_times_scale(c, e, dtype).reshape(lead + (k2, n)) for c in (p & 0x0F, p >> 4))
