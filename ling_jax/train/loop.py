"""`Trainer`: the train state of one model and the jitted step that advances it.

The trainer owns the state pytree and the batch placement; the maths is in `step.py`. Parameters
keep whatever sharding they were placed with; pass a mesh with a `data` axis and each batch is
split over it (when the batch size divides).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ling_jax.config import LingConfig
from ling_jax.model import LingForCausalLM
from ling_jax.train.config import TrainConfig
from ling_jax.train.flat import bias_layers, split_model
from ling_jax.train.step import StepSpec, initial_state, jitted_eval_loss, jitted_train_step
from sharding.mesh import mesh_sizes


class Trainer:
    """Holds the train state and runs the jitted step.

    `state` = {step, params, bias, rest, opt_state, rng}: params/bias/rest are flat dicts keyed
    'model/layers/0/attention/q_proj/weight' etc.; rng is raw uint32 key data.
    """

    def __init__(self, model: LingForCausalLM, tcfg: TrainConfig | None = None, mesh=None):
        self.cfg: LingConfig = model.cfg
        self.tcfg = tcfg or TrainConfig()
        self.mesh = mesh
        graphdef, params, bias, rest, paths = split_model(model)
        self.has_mtp = model.mtp is not None
        self.use_mtp = bool(self.tcfg.mtp and self.has_mtp)
        self.spec = StepSpec(graphdef=graphdef, paths=tuple(sorted(paths.items())),
                             bias_layer=tuple(sorted(bias_layers(self.cfg, bias.keys()).items())),
                             cfg=self.cfg, tcfg=self.tcfg, use_mtp=self.use_mtp)
        # Commit every array to its device(s): restored (Orbax) arrays are committed, and the step
        # must see the same input shardings before and after a restore to reuse its compilation.
        self.state = jax.tree.map(lambda a: a if getattr(a, "committed", True) else jax.device_put(a, a.sharding),
                                  initial_state(params, bias, rest, self.tcfg))

    # ---- model views --------------------------------------------------------------------------
    def merge(self, params, bias, rest) -> LingForCausalLM:
        return self.spec.merge(params, bias, rest)

    def model(self) -> LingForCausalLM:
        """The current model (shares the state's arrays)."""
        s = self.state
        return self.merge(s["params"], s["bias"], s["rest"])

    # ---- steps --------------------------------------------------------------------------------
    def _place_batch(self, ids, mask):
        """ids [B,T] on the mesh's `data` axis when it divides B; mask [B,T] bool (default: all real)."""
        ids = jnp.asarray(ids, jnp.int32)
        mask = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask, bool)
        n = mesh_sizes(self.mesh).get("data") if self.mesh is not None else None
        if n is not None and ids.shape[0] % n == 0:
            ids = jax.device_put(ids, NamedSharding(self.mesh, P("data", None)))
        return ids, mask

    def train_step(self, ids, mask=None) -> dict:
        """One optimizer step on ids [B,T] (mask [B,T] marks real tokens; default all).

        Returns metrics as Python floats plus 'load' [n_moe_layers, E] (numpy): loss, ce, mtp_ce,
        grad_norm, lr (the rate used by this step), max_load_ratio (max over layers and experts
        of load / mean load; 1 = perfectly balanced).
        """
        ids, mask = self._place_batch(ids, mask)
        self.state, m = jitted_train_step(self.spec, self.state, ids, mask)
        return {k: (np.asarray(v) if k == "load" else float(v)) for k, v in m.items()}

    def eval_loss(self, ids, mask=None) -> dict:
        ids, mask = self._place_batch(ids, mask)
        s = self.state
        return {k: float(v) for k, v in jitted_eval_loss(self.spec, s["params"], s["bias"], s["rest"], ids,
                                                             mask).items()}

    @property
    def step(self) -> int:
        return int(self.state["step"])
