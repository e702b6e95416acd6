"""Up-front validation of a converted (Orbax) checkpoint directory, before anything is restored.

A converted directory (`ling-jax convert`, layout in ling_jax/checkpoint/orbax.py) is trusted by Orbax as
written: a missing `groups` entry, a parameter recorded with the wrong shape, a group whose Orbax
commit marker is gone or a truncated data file were accepted, or failed deep inside TensorStore with
`OUT_OF_RANGE` / `DATA_LOSS` tracebacks. `validate_converted(path)` checks, in order, and raises one
`CheckpointError` naming the file, group or parameter:

1. the marker `ling_jax_orbax.json`: a JSON object of the current format and version;
2. `config.json` (the full config parser);
3. the manifest: `groups` a list of plain names, `params` an object whose every entry names a group
   of that list, a shape (non-negative integers) and a dtype a weight can have (float32 or bfloat16
   anywhere; float8_e4m3fn / uint8 only kept quantised and with their scales; never an integer,
   bool, float16 or float8_e5m2), each refusal naming the parameter;
4. shapes: every parameter the model of `config.json` has (MTP layer iff the manifest says so) is
   recorded, with the shape that model expects; no extra ones;
5. per group: the directory `params/<group>` with Orbax's commit marker `commit_success.txt` and its
   `_METADATA`;
6. data files: when the manifest records them (`data_files`: relative path -> size, written by
   `convert` from this version on), each exists with exactly that size (a truncated file fails here).

`storage_errors(group_dir)` turns what still fails while restoring (TensorStore, asyncio, Orbax) into
one CheckpointError line naming the group directory.
"""
from __future__ import annotations

import contextlib
import os
import re

from ling_jax.checkpoint.orbax import FORMAT, META, VERSION, scale_key
from ling_jax.checkpoint.safetensors_io import CheckpointError
from ling_jax.checks import is_int
from ling_jax.config import ConfigError, LingConfig, read_json_file

COMMIT_MARKER = "commit_success.txt"
ORBAX_METADATA = "_METADATA"
STORED_DTYPES = ("bfloat16", "float32", "float8_e4m3fn", "uint8")  # uint8: MXFP4 codes / E8M0 scales
FLOAT_DTYPES = ("float32", "bfloat16")
QUANT_DTYPES = ("float8_e4m3fn", "uint8")
_GROUP_RE = re.compile(r"^[A-Za-z0-9_]+$")


def data_file_inventory(params_dir: str) -> dict[str, int]:
    """{path relative to params_dir: size} of every file under it (recorded by convert, checked on load)."""
    out = {}
    for root, dirs, files in os.walk(params_dir):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            out[os.path.relpath(p, params_dir)] = os.path.getsize(p)
    return out


def _read_marker(path: str) -> dict:
    p = os.path.join(path, META)
    if not os.path.isfile(p):
        raise CheckpointError(f"{path}: not a converted checkpoint (no {META})")
    meta = read_json_file(p, CheckpointError)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: not a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        old = meta.get("format") == FORMAT and meta.get("version") == 1
        raise CheckpointError(f"{path}: {META} is not a {FORMAT} v{VERSION} marker" + (
            " (it is v1, written before routed experts moved to the [E, out, in] layout: run "
            "`ling-jax convert` on the original checkpoint again)" if old else ""))
    return meta


def _check_manifest(path: str, meta: dict) -> None:
    p = os.path.join(path, META)
    groups = meta.get("groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, str) and _GROUP_RE.match(g)
                                                             for g in groups):
        raise CheckpointError(f"{p}: 'groups' must be a non-empty list of group names, got {str(groups)[:60]}")
    params = meta.get("params")
    if not isinstance(params, dict) or not params:
        raise CheckpointError(f"{p}: 'params' must be a non-empty object")
    for key in ("keep_fp8", "with_mtp"):
        if not isinstance(meta.get(key), bool):
            raise CheckpointError(f"{p}: '{key}' must be true or false, got {meta.get(key)!r}")
    gs = set(groups)
    for k, e in params.items():
        if not isinstance(e, dict):
            raise CheckpointError(f"{p}: parameter {k}: entry is not an object")
        if e.get("group") not in gs:
            raise CheckpointError(f"{p}: parameter {k} is stored in group {e.get('group')!r}, which is not in "
                                  f"'groups' {groups}")
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{p}: parameter {k}: bad shape {shape!r}")
        problem = _param_dtype_problem(k, e.get("dtype"), params, meta["keep_fp8"])
        if problem is not None:
            raise CheckpointError(f"{p}: parameter {k}: {problem}")


def _param_dtype_problem(key: str, dtype, params: dict, keep_quantized: bool):
    """The converted path's dtype rule (the reader's, `reader.dtype_problem`): float32 or bfloat16 for
    any parameter (cast to the model's dtype on restore); float8_e4m3fn only for a parameter kept FP8,
    with its float32/bfloat16 scales beside it; uint8 only for MXFP4 codes with their uint8 scales
    (or for those scales). Integers, bools, float16 and float8_e5m2 are refused."""
    if dtype in FLOAT_DTYPES:
        return None
    scale = scale_key(key.split("__"))
    owners = [k for k, e in params.items() if k != key and isinstance(e, dict) and
              e.get("dtype") in QUANT_DTYPES and scale_key(k.split("__")) == key]
    if dtype == "uint8" and owners and params[owners[0]].get("dtype") == "uint8":
        return None  # MXFP4 E8M0 scales
    if dtype in QUANT_DTYPES:
        if not keep_quantized:
            return (f"dtype {dtype} but the manifest says keep_fp8 false (expected float32 or bfloat16; a "
                    f"quantised value restored as a float would be garbage)")
        s = params.get(scale)
        want = FLOAT_DTYPES if dtype == "float8_e4m3fn" else ("uint8",)
        if not isinstance(s, dict) or s.get("dtype") not in want:
            got = "missing" if not isinstance(s, dict) else f"of dtype {s.get('dtype')!r}"
            return f"dtype {dtype} needs its block scales {scale} of dtype {' or '.join(want)} ({got})"
        return None
    if dtype == "float16":
        return ("dtype float16 is refused (a bfloat16 value relabelled float16 would load as garbage): expected "
                "float32 or bfloat16")
    if isinstance(dtype, str) and dtype.startswith("float8"):
        return f"dtype {dtype}: FP8 values must be float8_e4m3fn with block scales"
    return f"dtype {dtype!r} is not one of {STORED_DTYPES} (a weight must be a float)"


def check_param_shapes(path: str, meta: dict, expected: dict[str, tuple], subset: bool = False) -> None:
    """Every parameter of `expected` ({key: shape}) recorded with that shape; no others unless `subset`
    (loading part of the model, e.g. without the MTP layer)."""
    path = os.path.abspath(path)
    p = os.path.join(path, META)
    params = meta["params"]
    for k, shape in expected.items():
        if k not in params:
            raise CheckpointError(f"{p}: parameter {k} (shape {list(shape)}, required by config.json) is missing")
        if tuple(params[k]["shape"]) != tuple(shape):
            raise CheckpointError(f"{p}: parameter {k} is recorded with shape {params[k]['shape']} but "
                                  f"config.json implies {list(shape)}")
    extra = [k for k in params if k not in expected]
    if extra and not subset:
        raise CheckpointError(f"{p}: unexpected parameter {extra[0]} (not part of the model described by "
                              f"config.json)" + (f" and {len(extra) - 1} more" if len(extra) > 1 else ""))


def _check_groups(path: str, meta: dict) -> None:
    for g in meta["groups"]:
        d = os.path.join(path, "params", g)
        if not os.path.isdir(d):
            raise CheckpointError(f"{d}: group directory listed in {META} is missing")
        for f, what in ((COMMIT_MARKER, "Orbax commit marker"), (ORBAX_METADATA, "Orbax metadata")):
            if not os.path.isfile(os.path.join(d, f)):
                raise CheckpointError(f"{d}: {what} {f} is missing (the save of this group did not complete; "
                                      f"convert again)")
    inv = meta.get("data_files")
    if inv is None:
        return
    if not isinstance(inv, dict):
        raise CheckpointError(f"{os.path.join(path, META)}: 'data_files' must be an object")
    base = os.path.join(path, "params")
    for rel, size in inv.items():
        fp = os.path.join(base, rel)
        if not isinstance(rel, str) or ".." in rel.split(os.sep) or os.path.isabs(rel):
            raise CheckpointError(f"{os.path.join(path, META)}: bad data file name {rel!r}")
        if not os.path.isfile(fp):
            raise CheckpointError(f"{fp}: Orbax data file is missing")
        got = os.path.getsize(fp)
        if got != size:
            raise CheckpointError(f"{fp}: Orbax data file has {got} bytes, {size} were written (truncated or "
                                  f"modified; convert again)")


def validate_converted(path: str, expected_shapes=None) -> dict:
    """Check a converted directory (see the module docstring); returns its manifest (the marker JSON).

    expected_shapes(cfg, meta) -> {parameter key: shape}: the parameters the model of config.json has
    (the loader passes the shapes of its abstract model); None skips the shape check (4.).
    """
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: checkpoint directory not found")
    meta = _read_marker(path)
    try:
        cfg = LingConfig.from_json(os.path.join(path, "config.json"))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    _check_manifest(path, meta)
    if expected_shapes is not None:
        check_param_shapes(path, meta, expected_shapes(cfg, meta))
    _check_groups(path, meta)
    return meta


@contextlib.contextmanager
def storage_errors(group_dir: str):
    """Re-raise any failure of the storage layer while restoring `group_dir` as one CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:  # TensorStore (ValueError/RuntimeError with a status code), asyncio, Orbax
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{group_dir}: cannot read the Orbax data ({type(e).__name__}: {first[:200]}); the "
                              f"converted checkpoint is damaged: convert the original again") from None
