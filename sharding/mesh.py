"""Device meshes from a short text spec: `data=1,expert=8,model=4`.

Every mesh built here has exactly the three axes `("data", "expert", "model")`, in that order
(an axis the spec omits has size 1), so the partition rules can always name all three:

* `data`   - batch (sequences) of activations and caches; weights are replicated along it.
* `expert` - routed experts of the MoE layers (expert parallelism).
* `model`  - attention heads (KDA and MLA), vocabulary, dense FFN widths and the routed experts'
             intermediate width (tensor parallelism).

One size may be `-1` (or `*`): it takes whatever the others leave. Axes are laid out so that
`model` varies fastest over `jax.devices()` (neighbouring devices), then `expert`, then `data`.
"""
from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "expert", "model")
ALIASES = {"dp": "data", "batch": "data", "ep": "expert", "experts": "expert", "tp": "model", "mp": "model"}


def parse_mesh_shape(spec: str | None, n_devices: int | None = None) -> dict[str, int]:
    """`"data=1,expert=8,model=4"` → {"data": 1, "expert": 8, "model": 4}: THE mesh-spec parser
    (`--mesh` of logits / generate / convert and of `plan`, which plans meshes it does not have).

    None / "auto" → `default_mesh_shape(n_devices or 1)` (every device on `expert`). Omitted axes
    are 1; aliases dp/tp/ep. One size may be `-1`/`*` (the rest of the devices): that needs
    `n_devices`. With `n_devices`, the product must equal it. Raises ValueError naming the problem.
    """
    if spec is None or (isinstance(spec, str) and spec.strip() == "auto"):
        return default_mesh_shape(1 if n_devices is None else n_devices)

    def bad(why: str):
        return ValueError(f"--mesh: bad mesh spec {spec!r}: {why}")

    items = [x.strip() for x in str(spec).split(",")]
    if not any(items):
        raise bad("empty (expected axis=size items like expert=4,model=2)")
    sizes: dict[str, int] = {}
    free = None
    for part in items:
        if not part:
            continue
        if part.count("=") != 1:
            raise bad(f"expected axis=size items like expert=4,model=2, got {part!r}")
        name, val = (x.strip() for x in part.split("="))
        name = ALIASES.get(name, name)
        if name not in AXES:
            raise bad(f"unknown axis {name!r} (axes: {', '.join(AXES)})")
        if name in sizes or name == free:
            raise bad(f"axis {name!r} given twice")
        if val in ("-1", "*"):
            if free is not None:
                raise bad("only one axis may be -1")
            if n_devices is None:
                raise bad(f"size {val} of {name!r} (the rest of the devices) needs a device count; give every size")
            free = name
            continue
        if not re.fullmatch(r"[+-]?[0-9]+", val):
            raise bad(f"size of {name!r} must be an integer, got {val!r}")
        n = int(val)
        if n < 1:
            raise bad(f"size of {name!r} must be >= 1, got {n}")
        sizes[name] = n
    used = math.prod(sizes.values())
    if free is not None:
        if n_devices % used:
            raise bad(f"{n_devices} devices are not divisible by {used}")
        sizes[free] = n_devices // used
        used = n_devices
    if n_devices is not None and used != n_devices:
        raise bad(f"it needs {used} devices but {n_devices} are available "
                  f"(the product of the axis sizes must equal the device count)")
    return {a: sizes.get(a, 1) for a in AXES}


def default_mesh_shape(n_devices: int) -> dict[str, int]:
    """The default layout: every device on `expert`.

    Routed experts are ~97% of Ling-3.1-flash's weights, so splitting them is what makes the model
    fit; the expert-parallel MoE then needs one psum per layer and no weight traffic. Attention,
    embeddings and dense FFNs stay replicated (`model=1`), which costs no communication at all.
    Use e.g. `expert=8,model=4` explicitly for tensor parallelism on larger slices.
    """
    return {"data": 1, "expert": n_devices, "model": 1}


def make_mesh(shape: dict[str, int], devices: Sequence | None = None) -> Mesh:
    """A Mesh over `devices` (default: all, globally) with axes AXES sized by `shape`.

    Axis types are Auto (GSPMD propagation; the MoE uses an explicit shard_map).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(int(shape.get(a, 1)) for a in AXES)
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {math.prod(sizes)} devices, have {len(devices)}")
    # Keep each process's devices contiguous (jax.devices() is ordered by process), so `model`
    # (the chattiest axis) stays inside a host whenever its size divides the local device count.
    arr = np.array(devices, dtype=object).reshape(sizes)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def parse_mesh(spec: str | None = None, devices: Sequence | None = None) -> Mesh:
    """`--mesh SPEC` → Mesh over all (global) devices; see `parse_mesh_shape` for the format."""
    devices = list(jax.devices() if devices is None else devices)
    return make_mesh(parse_mesh_shape(spec, len(devices)), devices)


def mesh_sizes(mesh) -> dict[str, int]:
    """{axis: size} of a Mesh / AbstractMesh, or of a plain {axis: size} dict (planning without devices)."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def mesh_spec_string(mesh) -> str:
    """Inverse of parse_mesh_shape: `data=1,expert=8,model=1`."""
    s = mesh_sizes(mesh)
    return ",".join(f"{a}={s.get(a, 1)}" for a in AXES)
