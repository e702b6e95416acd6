"""Streaming, validating reader of a release-format checkpoint directory.

    r = CheckpointReader(path)          # parses config.json, the index and every shard header
    r.validate()                        # names / shapes / dtypes against layout.expected_tensors
    w = r.get("model.layers.0.attention.q_proj.weight")            # float32, FP8 dequantized
    rows = r.get(name, index=(slice(0, 256), slice(None)))          # reads only those rows

FP8 handling follows the spec's loader rule (§12.7): a tensor is dequantized iff its stored dtype
is F8_E4M3, and then its sibling `<module>.weight_scale_inv` must exist. Nothing is hard-coded
about which modules are quantized. The reader opens files read-only and never writes.

Order of checks (so the most specific reason is the one reported): config.json; every shard header;
the claimed tensor count against the headers (`bounds.check_claims`, before anything enumerates
the config's tensors); then `validate()`: per-tensor problems (name, expected vs found), and the
index's `metadata.total_size` disagreement only when no per-tensor problem explains it. Reading a
tensor (`get`, `get_raw`) checks its values as they stream: no NaN/Inf (FP8 NaN bytes included)
and block scales positive and finite (`check_values=False` skips this).

MXFP4 routed experts (`ling_jax.checkpoint.mxfp4`) are recognised by BOTH the config
(`quantization_config.routed_experts_quant_method: mxfp4`, group size 32) and the stored dtypes
(U8 packed codes `weight [out, in/2]` + U8/F8_E8M0 `weight_scale_inv [out, in/32]`); one without the
other is a problem naming the tensor. `get` decodes them exactly (float32) and refuses a NaN scale
byte (0xFF); `get_mxfp4_codes` / `get_mxfp4_scales` return the raw bytes for the loader's
`--keep-quantized`.

Stored dtypes (`dtype_problem`): every unquantised float tensor may be stored BF16 or F32, whatever
the release stores (a framework that keeps routers or norms in float32 writes F32; the values are
converted to the model's dtype as any other stored value is); F8_E4M3 only for a linear matrix and
then with its F32/BF16 `weight_scale_inv`. Refused, naming the tensor: integers and BOOL (no float
weight), F8 without its scale, F8_E5M2 (E4M3 is the format), and F16 (a BF16 tensor relabelled
F16 has the right size and would load as garbage). Problems are listed most specific first: those
of a stored tensor (dtype, shape, scale) before unexpected and missing tensors, and the index's
`total_size` last.
"""
from __future__ import annotations

import math
import os
import numpy as np

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint import mxfp4 as MX
from ling_jax.checkpoint.bounds import check_claims
from ling_jax.checkpoint.values import first_nonfinite, first_nonpositive
from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK, block_dequant_fp8, scale_grid_shape
from ling_jax.checkpoint.safetensors_io import CheckpointError, TensorInfo, _normalize_index, open_shards
from ling_jax.checks import check_int
from ling_jax.config import ConfigError, LingConfig

SCALE_DTYPES = ("F32", "BF16")
FLOAT_DTYPES = ("BF16", "F32")  # any unquantised float tensor, converted to the model's dtype on load
FP8 = "F8_E4M3"
MAX_LISTED = 8  # problems listed after the first in a validate() error
_INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")
#: environment switch for the value checks of every reader created without `check_values=` (CLI flag
#: `--skip-value-checks` sets it): "1" skips them.
SKIP_VALUE_CHECKS_ENV = "LING_JAX_SKIP_VALUE_CHECKS"


def allowed_dtypes(spec: L.TensorSpec) -> tuple[str, ...]:
    """Stored dtypes accepted for a tensor: BF16 or F32 for any (whatever the release stores), and
    F8_E4M3 for a linear matrix (with its block scale, checked apart)."""
    return FLOAT_DTYPES + ((FP8,) if spec.kind == L.LINEAR else ())


def dtype_problem(name: str, dtype: str, spec: L.TensorSpec) -> str | None:
    """Why `name` cannot be stored as `dtype` (None when it can; an F8_E4M3 matrix's scale is checked
    apart). The reason says what was expected."""
    allowed = allowed_dtypes(spec)
    if dtype in allowed:
        return None
    want = "BF16 or F32" + (f" (or {FP8} with its block scale {L.scale_name(name)!r})" if FP8 in allowed else "")
    if dtype in _INTEGER_DTYPES:
        what = "a boolean" if dtype == "BOOL" else "an integer"
        return f"tensor {name!r} has dtype {dtype}, {what} type; a weight must be a float: {want}"
    if dtype == "F16":
        return (f"tensor {name!r} has dtype F16, which is refused (a BF16 tensor relabelled F16 has the same "
                f"size and would load as garbage): expected {want}")
    if dtype.startswith("F8_"):
        if FP8 not in allowed:
            return (f"tensor {name!r} is stored {dtype}, but only linear matrices may be FP8 (this is a "
                    f"{spec.kind} tensor): expected BF16 or F32")
        return f"tensor {name!r} is stored {dtype}, but FP8 weights must be {FP8} with a block scale: expected {want}"
    return f"tensor {name!r} has dtype {dtype}: expected {want}"


class CheckpointReader:
    """Read-only view of a checkpoint directory (config.json + safetensors shards)."""

    def __init__(self, path: str, check_values: bool | None = None):
        self.check_values = (os.environ.get(SKIP_VALUE_CHECKS_ENV) != "1") if check_values is None \
            else bool(check_values)
        self.dir = os.path.abspath(path)
        if not os.path.isdir(self.dir):
            raise CheckpointError(f"{self.dir}: checkpoint directory not found")
        cfg_path = os.path.join(self.dir, "config.json")
        if not os.path.isfile(cfg_path):
            raise CheckpointError(f"{cfg_path}: missing config.json")
        try:
            self.config: LingConfig = LingConfig.from_json(cfg_path)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        self.block = tuple(self.config.weight_block_size or DEFAULT_BLOCK)
        self._files, self._where, meta, self.index_path = open_shards(self.dir)
        self.total_size = sum(t.nbytes for t in self._where.values())
        ts = meta.get("total_size")
        if ts is not None:
            check_int(ts, f"{self.index_path}: metadata.total_size", expected="an integer", error=CheckpointError)
        self.index_total_size = ts  # compared in problems(), after the per-tensor checks
        self.header_only = any(f.header_only for f in self._files.values())
        claim = check_claims(self.config, len(self._where), cfg_path, self.index_path)
        if claim is not None:
            raise CheckpointError(claim)

    # ---- queries ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(f"{self.index_path}: no tensor {name!r} in the checkpoint") from None

    def spec(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, stored safetensors dtype) of a tensor."""
        t = self.info(name)
        return t.shape, t.dtype

    def file_of(self, name: str) -> str:
        return self.info(name).file

    def is_mxfp4(self, name: str) -> bool:
        """A routed expert weight stored as MXFP4 codes (U8; the config must declare it, see problems())."""
        return L.is_routed_expert_weight(name) and self.info(name).dtype == MX.PACKED_DTYPE

    def _mxfp4_pair(self, name: str):
        """(codes info, scale info) of an MXFP4 expert after the header checks (one-line error)."""
        t = self.info(name)
        sn = L.scale_name(name)
        st = self._where.get(sn)
        if not self.config.routed_experts_mxfp4:
            raise CheckpointError(self._undeclared(name))
        probs = self._pair_problems(name, None)
        if probs:
            raise CheckpointError(probs[0])
        return t, st

    def _pair_problems(self, name: str, logical) -> list[str]:
        """`mxfp4.mxfp4_problems` of an expert's (codes, scale) pair, each prefixed by its file."""
        t, sn = self.info(name), L.scale_name(name)
        st = self._where.get(sn)
        return [f"{st.file if st is not None and p.startswith(sn + ':') else t.file}: {p}"
                for p in MX.mxfp4_problems(name, t.shape, t.dtype, sn, st and st.shape, st and st.dtype, logical)]

    def _undeclared(self, name: str) -> str:
        return (f"{self.info(name).file}: routed expert {name!r} is stored {MX.PACKED_DTYPE} (MXFP4 codes) but "
                f"{os.path.join(self.dir, 'config.json')} does not declare "
                f"quantization_config.routed_experts_quant_method: mxfp4")

    def get_mxfp4_codes(self, name: str, index=None) -> np.ndarray:
        """Raw packed codes (uint8 [out, in/2], block `index` of them) of an MXFP4 expert."""
        self._mxfp4_pair(name)
        return self.get_raw(name, index)

    def get_mxfp4_scales(self, name: str, index=None) -> np.ndarray:
        """Raw E8M0 scale bytes (uint8 [out, in/32], block `index`) of an MXFP4 expert. NaN bytes
        (0xFF) are refused naming the scale tensor, always: a NaN scale is a format error."""
        _, st = self._mxfp4_pair(name)
        sn = L.scale_name(name)
        scales = np.ascontiguousarray(self._files[os.path.basename(st.file)].read(sn, index)).view(np.uint8)
        MX.check_scale_bytes(scales, f"{st.file}: {sn}")
        return scales

    def is_quantized(self, name: str) -> bool:
        """True iff stored FP8 E4M3 (then `weight_scale_inv` is required)."""
        return self.info(name).dtype == FP8

    def get_raw(self, name: str, index=None) -> np.ndarray:
        """Stored values (stored dtype, no dequantization); `index`: ints / slices / Ellipsis."""
        t = self.info(name)
        a = self._files[os.path.basename(t.file)].read(name, index)
        if self.check_values:
            bad = first_nonfinite(a, t.dtype)
            if bad is not None:
                where = "" if index is None else " (in the block read)"
                raise CheckpointError(f"{t.file}: tensor {name!r} holds a non-finite value (NaN/Inf) at "
                                      f"index {list(bad)}{where}; the checkpoint is corrupt (pass "
                                      f"--skip-value-checks to load it anyway)")
        return a

    def get_scale(self, name: str) -> np.ndarray:
        """float32 block-scale grid of an FP8 weight."""
        sn = L.scale_name(name)
        t = self.info(name)
        if sn not in self._where:
            raise CheckpointError(f"{t.file}: tensor {name!r} is stored {t.dtype} but its scale {sn!r} "
                                  f"is missing")
        st = self.info(sn)
        want = scale_grid_shape(t.shape, self.block) if len(t.shape) == 2 else None
        if want is None or st.shape != want:
            raise CheckpointError(f"{st.file}: scale {sn!r} has shape {list(st.shape)}, expected {list(want or ())} "
                                  f"(ceil grid of {list(t.shape)} with block {list(self.block)})")
        s = self.get_raw(sn).astype(np.float32)
        if self.check_values:
            bad = first_nonpositive(s)
            if bad is not None:
                raise CheckpointError(f"{st.file}: scale {sn!r} has a block scale {float(s[bad])} at {list(bad)}; "
                                      f"block scales must be positive and finite")
        return s

    def get(self, name: str, dtype=np.float32, index=None) -> np.ndarray:
        """Values of `name` (FP8 dequantized: float32(Wq) × scale per block) cast to `dtype`.

        `index` selects a sub-block (ints / slices / Ellipsis); only the selected bytes are read.
        """
        t = self.info(name)
        if t.dtype == MX.PACKED_DTYPE and L.is_routed_expert_weight(name):
            return self._get_mxfp4(name, dtype, index)
        if t.dtype != FP8:
            return self.get_raw(name, index).astype(dtype, copy=False)
        if len(t.shape) != 2:
            raise CheckpointError(f"{t.file}: FP8 tensor {name!r} has shape {list(t.shape)}; only 2-D "
                                  f"matrices can be block-quantized")
        scale = self.get_scale(name)
        if index is None:
            return block_dequant_fp8(self.get_raw(name), scale, self.block).astype(dtype, copy=False)
        idx = _normalize_index(index, t.shape)
        wq = self.get_raw(name, idx)
        rows = np.arange(t.shape[0])[idx[0]]
        cols = np.arange(t.shape[1])[idx[1]]
        s = scale[np.ix_(np.atleast_1d(rows) // self.block[0], np.atleast_1d(cols) // self.block[1])]
        return (wq.astype(np.float32) * s.reshape(wq.shape)).astype(dtype, copy=False)

    def _get_mxfp4(self, name: str, dtype, index) -> np.ndarray:
        """Decoded block `index` (over the logical [out, in] shape) of an MXFP4 expert: whole groups of
        32 inputs are read and decoded, then the block is cut out."""
        t, _ = self._mxfp4_pair(name)
        logical = (t.shape[0], 2 * t.shape[1])
        r_sl, c_sl = _normalize_index(index, logical)
        cols = range(logical[1])[c_sl] if isinstance(c_sl, slice) else range(c_sl, c_sl + 1)
        if len(cols) == 0 or cols.step < 0:
            return self.get(name, np.float32)[r_sl, c_sl].astype(dtype, copy=False)
        g0, g1 = cols.start // MX.GROUP, cols[-1] // MX.GROUP + 1
        packed = self.get_mxfp4_codes(name, (r_sl, slice(g0 * MX.GROUP // 2, g1 * MX.GROUP // 2)))
        scales = self.get_mxfp4_scales(name, (r_sl, slice(g0, g1)))
        x = MX.dequantize_mxfp4(packed, scales, name)
        sub = x[..., slice(cols.start - g0 * MX.GROUP, cols[-1] - g0 * MX.GROUP + 1, cols.step)]
        if not isinstance(c_sl, slice):
            sub = sub[..., 0]
        return sub.astype(dtype, copy=False)

    # ---- validation ---------------------------------------------------------------------------
    def _mxfp4_problems(self, expected: dict) -> tuple[list[str], set]:
        """Problems of the MXFP4 experts (config vs stored dtypes, shapes against the config) and the
        names they cover (skipped by the generic checks)."""
        out: list[str] = []
        covered: set = set()
        declared = self.config.routed_experts_mxfp4
        cfg_file = os.path.join(self.dir, "config.json")
        for name, t in self._where.items():
            if not L.is_routed_expert_weight(name) or name not in expected:
                continue
            if t.dtype == MX.PACKED_DTYPE:
                sn = L.scale_name(name)
                covered |= {name, sn}
                if not declared:
                    out.append(self._undeclared(name))
                    continue
                out += self._pair_problems(name, expected[name].shape)
            elif declared:
                covered.add(name)
                out.append(f"{t.file}: routed expert {name!r} is stored {t.dtype}, but {cfg_file} declares "
                           f"MXFP4 routed experts (expected {MX.PACKED_DTYPE} codes)")
        return out, covered

    def problems(self, include_mtp: bool = True) -> list[str]:
        """Every disagreement between the stored tensors and `expected_tensors(config)`, most
        specific first: a stored tensor's own problems (dtype, shape, scale), then unexpected
        tensors, then missing ones, then the index's total_size (only when nothing else explains it)."""
        cfg = self.config
        expected = L.expected_tensors(cfg, include_mtp=True)
        mtp_prefix = f"model.layers.{cfg.num_hidden_layers}." if cfg.has_mtp else None
        out, mx_covered = self._mxfp4_problems(expected)
        unexpected: list[str] = []
        cfg_file = os.path.join(self.dir, "config.json")
        for name, t in self._where.items():
            if name in mx_covered:
                continue
            w = L.weight_of_scale(name)
            if w is not None and w in expected:
                spec = expected[w]
                if w not in self._where:
                    out.append(f"{t.file}: scale {name!r} has no weight {w!r}")
                elif self._where[w].dtype != FP8:
                    out.append(f"{t.file}: scale {name!r} belongs to {w!r}, which is stored "
                               f"{self._where[w].dtype}, not {FP8}")
                if t.dtype not in SCALE_DTYPES:
                    out.append(f"{t.file}: scale {name!r} has dtype {t.dtype}, expected one of {SCALE_DTYPES}")
                want = scale_grid_shape(spec.shape, self.block)
                if t.shape != want:
                    out.append(f"{t.file}: scale {name!r} has shape {list(t.shape)}, expected {list(want)} "
                               f"(ceil grid of {list(spec.shape)} with block {list(self.block)})")
                continue
            spec = expected.get(name)
            if spec is None:
                unexpected.append(f"{t.file}: unexpected tensor {name!r} (not part of the model described by "
                                  f"{cfg_file})")
                continue
            if t.shape != spec.shape:
                out.append(f"{t.file}: tensor {name!r} has shape {list(t.shape)} but {cfg_file} implies "
                           f"{list(spec.shape)}")
            why = dtype_problem(name, t.dtype, spec)
            if why is not None:
                if spec.kind == L.LINEAR and L.scale_name(name) in self._where and t.dtype not in _INTEGER_DTYPES:
                    out.append(f"{t.file}: tensor {name!r} has a block scale {L.scale_name(name)!r} but is "
                               f"stored {t.dtype}, not {FP8}")
                else:
                    out.append(f"{t.file}: {why}")
            if t.dtype == FP8 and spec.kind == L.LINEAR and L.scale_name(name) not in self._where:
                out.append(f"{t.file}: tensor {name!r} is {FP8} but its scale {L.scale_name(name)!r} is missing "
                           f"(an FP8 matrix needs its block scale)")
        out += unexpected
        for name in expected:
            if name in self._where or (not include_mtp and mtp_prefix and name.startswith(mtp_prefix)):
                continue
            out.append(f"{self.index_path}: missing tensor {name!r} (shape {list(expected[name].shape)}, "
                       f"required by {cfg_file})")
        if not out and self.index_total_size is not None and self.index_total_size != self.total_size:
            out.append(f"{self.index_path}: metadata.total_size={self.index_total_size} but the shards hold "
                       f"{self.total_size} tensor bytes")
        return out

    def validate(self, include_mtp: bool = True) -> None:
        """Raise CheckpointError unless the checkpoint matches: the most specific problem first, then
        every other one (up to MAX_LISTED of them, on the same line)."""
        probs = self.problems(include_mtp)
        if probs:
            more = ""
            if len(probs) > 1:
                rest = probs[1:1 + MAX_LISTED]
                more = (f" (and {len(probs) - 1} more problem{'s' if len(probs) > 2 else ''}: " + "; ".join(rest)
                        + ("; ..." if len(probs) - 1 > MAX_LISTED else "") + ")")
            err = CheckpointError(probs[0] + more)
            err.problems = probs
            raise err

    def num_params(self, include_scales: bool = False) -> int:
        return sum(math.prod(t.shape) for n, t in self._where.items()
                   if include_scales or not n.endswith(L.SCALE_SUFFIX))

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
