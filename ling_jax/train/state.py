"""Train-state I/O: save and restore a `Trainer`'s state with an Orbax CheckpointManager.

Each saved step holds the state pytree (`state`, Orbax StandardSave) and JSON metadata (`meta`:
step, model config, train config, data position, whether the model has an MTP layer), so a train
directory alone rebuilds the model (`load_trained_model`) or resumes training exactly
(`restore_state` + `BatchStream.set_position(meta["data_position"])`).
"""
from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ling_jax.config import LingConfig
from ling_jax.loader import abstract_model
from ling_jax.model import LingForCausalLM
from ling_jax.train.config import TrainConfig
from ling_jax.train.flat import merge_model, split_model
from ling_jax.train.loop import Trainer
from ling_jax.train.step import make_optimizer


def checkpoint_manager(directory: str, max_to_keep: int = 3) -> ocp.CheckpointManager:
    """An Orbax CheckpointManager over `directory` (created if missing); `save_state` decides when to save."""
    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts)


def save_state(mngr: ocp.CheckpointManager, trainer: Trainer, data_position: Optional[dict] = None, every: int = 1,
               force: bool = False, extra: Optional[dict] = None) -> bool:
    """Save the train state + JSON metadata (model config, train config, data position) at the
    trainer's current step when it is a multiple of `every` (or `force`). Asynchronous: call
    `mngr.wait_until_finished()` before reading it back."""
    step = trainer.step
    if not force and (every <= 0 or step % every):
        return False
    if step in mngr.all_steps():
        return False
    meta = {"step": step, "model_config": trainer.cfg.to_dict(), "train_config": trainer.tcfg.to_dict(),
            "data_position": data_position, "with_mtp": trainer.has_mtp, **(extra or {})}
    return mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(trainer.state),
                                                   meta=ocp.args.JsonSave(meta)), force=True)


def restore_state(mngr: ocp.CheckpointManager, trainer: Trainer, step: Optional[int] = None) -> dict:
    """Restore into `trainer` (same model config); returns the saved metadata."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{mngr.directory}: no Orbax checkpoint to restore")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                            trainer.state)
    r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                   meta=ocp.args.JsonRestore()))
    trainer.state = r["state"]
    return r["meta"]


def read_meta(directory: str, step: Optional[int] = None) -> tuple[int, dict]:
    """(step, metadata) of an Orbax train directory (the manager root)."""
    mngr = checkpoint_manager(directory)
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{directory}: no Orbax checkpoint found")
    meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return step, meta


def load_trained_model(directory: str, step: Optional[int] = None, dtype=jnp.float32) -> LingForCausalLM:
    """The model stored in an Orbax train directory (params + trained expert_bias)."""
    step, meta = read_meta(directory, step)
    cfg = LingConfig.from_dict(meta["model_config"], f"{directory} (orbax metadata)")
    # Shapes only: every array (parameters and the per-layer constants in `rest`) is restored below.
    model = abstract_model(cfg, dtype, meta.get("with_mtp", True))
    graphdef, params, bias, rest, paths = split_model(model)
    tcfg = TrainConfig.from_dict(meta.get("train_config") or {})
    # Restore only the model arrays (optimizer state is not needed): build its abstract tree.
    mngr = checkpoint_manager(directory)
    tx = make_optimizer(tcfg)
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "bias": bias, "rest": rest,
                "opt_state": jax.eval_shape(tx.init, params),
                "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))}
    r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    return merge_model(graphdef, paths, r["params"], r["bias"], r["rest"])
