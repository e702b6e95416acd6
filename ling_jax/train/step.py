"""The train step: forward, loss, gradient, optimizer update and expert-bias balancing, as pure functions.

Loss (spec §11): `CE(main logits[t], x[t+1]) + λ · CE(mtp logits[t], x[t+2])` averaged over the
valid slots (the main head ignores the last slot, the MTP head the last two). λ is the config's
`mtp_loss_scaling_factor` when it is non-zero, otherwise `TrainConfig.mtp_weight` (default 0.3, the
DeepSeek-V3 value for the first part of training), because released configs omit the factor.

Optimizer: `clip_by_global_norm` → AdamW (weight decay on ≥2-D matrices except conv taps) with a
linear-warmup + cosine-decay learning rate.

MoE load balancing (no auxiliary loss, DeepSeek-V3): `mlp.gate.expert_bias` gets no gradient and is
not seen by the optimizer. After every step each MoE layer's bias moves by
`bias += bias_rate · sign(mean_load − load)`, where `load[e]` is the fraction of this step's routed
assignments (tokens × top-k) that went to expert e and `mean_load = 1/E`.

The train state is a plain pytree (`initial_state`): {step, params, bias, rest, opt_state, rng} with
params/bias/rest the flat dicts of `flat.split_model`. Everything static about a step (graph
definition, key paths, configs) is one hashable `StepSpec`, a static argument of the jitted
functions, so equal specs share one compilation (resume in-process, tests) without a cache of ours.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ling_jax.call_mode import TRAIN
from ling_jax.config import LingConfig
from ling_jax.model import LingForCausalLM
from ling_jax.train.config import TrainConfig, mtp_lambda
from ling_jax.train.flat import merge_model


# ---------------------------------------------------------------------------------------------
# optimizer
# ---------------------------------------------------------------------------------------------
def lr_schedule(tcfg: TrainConfig):
    warm = max(0, int(tcfg.warmup_steps))
    total = max(int(tcfg.total_steps), warm + 1)
    return optax.warmup_cosine_decay_schedule(0.0, tcfg.lr, warm, total, end_value=tcfg.lr * tcfg.min_lr_ratio)


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    # weight decay on >= 2-D matrices except the conv taps
    mask = lambda params: {k: v.ndim >= 2 and not k.endswith("conv1d") for k, v in params.items()}  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(tcfg.clip_norm),
                       optax.adamw(lr_schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps,
                                   weight_decay=tcfg.weight_decay, mask=mask))


# ---------------------------------------------------------------------------------------------
# forward and loss
# ---------------------------------------------------------------------------------------------
def forward(model: LingForCausalLM, ids, *, mtp: bool, remat: bool = False, policy: str = "nothing_saveable",
            chunk_size: int = 64):
    """Cache-free training forward. Returns (logits [B,T,V], mtp_logits or None, routing {layer: [B,T,k]}).

    The model's own layer runner (`layer_stack.run_block`) with KDA in chunk mode; with remat every
    decoder layer body and the MTP block run under `jax.checkpoint(policy)` (`ExecConfig.remat`), so
    the backward pass keeps only each layer's input. The native CPU experts kernel is off: it is
    forward-only (its VJP recomputes through the XLA reference, every used expert on every token),
    so training takes the XLA paths, whose backward is sized by the assignments.
    """
    ex = model.exec.replace(kda_chunk=chunk_size, remat=policy if remat else None, native_experts=False,
                            native_attention=False, native_linear=False)
    out = model(ids, mtp=mtp, exec=ex, mode=TRAIN)
    return out["logits"], out.get("mtp_logits"), out["routing"]


def cross_entropy(logits, labels, mask):
    """Mean CE over mask; returns (mean, sum, count)."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    m = mask.astype(jnp.float32)
    s = jnp.sum(ce * m)
    n = jnp.sum(m)
    return s / jnp.maximum(n, 1.0), s, n


def lm_losses(logits, mtp_logits, ids, mask=None):
    """Main CE (slot t → x[t+1]) and MTP CE (slot t → x[t+2]). mask [B,T]: which tokens are real."""
    B, T = ids.shape
    mask = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    main, _, _ = cross_entropy(logits[:, :-1], ids[:, 1:], mask[:, 1:] & mask[:, :-1])
    if mtp_logits is None or T < 3:
        return main, jnp.zeros((), jnp.float32)
    mt, _, _ = cross_entropy(mtp_logits[:, :-2], ids[:, 2:], mask[:, 2:] & mask[:, :-2])
    return main, mt


def expert_load(routing: dict, num_experts: int, mask=None) -> dict:
    """{layer: fraction of routed assignments per expert [E]} (mask [B,T] drops padding)."""
    out = {}
    for layer, idx in routing.items():
        w = jnp.ones(idx.shape, jnp.float32) if mask is None else jnp.broadcast_to(mask[..., None], idx.shape)
        counts = jnp.zeros((num_experts,), jnp.float32).at[idx.reshape(-1)].add(w.reshape(-1).astype(jnp.float32))
        out[layer] = counts / jnp.maximum(counts.sum(), 1.0)
    return out


def update_expert_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 aux-loss-free rule: `bias += rate · sign(mean_load − load)` (float32)."""
    return (bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)


# ---------------------------------------------------------------------------------------------
# the step
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What a train step needs besides arrays; hashable, so it is a static argument of `jax.jit`.

    paths: ((flat key, module path), ...) of every state key (`flat.split_model`);
    bias_layer: ((decoder layer index, (expert_bias key, index in it)), ...) (`flat.bias_layers`);
    use_mtp: train the MTP head (tcfg.mtp and the model has one).
    """
    graphdef: Any
    paths: tuple
    bias_layer: tuple
    cfg: LingConfig
    tcfg: TrainConfig
    use_mtp: bool

    def merge(self, params: dict, bias: dict, rest: dict) -> LingForCausalLM:
        return merge_model(self.graphdef, dict(self.paths), params, bias, rest)


def initial_state(params: dict, bias: dict, rest: dict, tcfg: TrainConfig) -> dict:
    """{step, params, bias, rest, opt_state, rng}: step 0, fresh optimizer moments, the seed's key data."""
    return {"step": jnp.zeros((), jnp.int32), "params": params, "bias": bias, "rest": rest,
            "opt_state": jax.jit(make_optimizer(tcfg).init)(params),
            "rng": jax.random.key_data(jax.random.key(tcfg.seed))}


def loss_fn(spec: StepSpec, params: dict, bias: dict, rest: dict, ids, mask):
    """(loss, {ce, mtp_ce, routing}) of ids [B,T] with mask [B,T] (real tokens)."""
    model = spec.merge(params, bias, rest)
    tcfg = spec.tcfg
    logits, mtp_logits, routing = forward(model, ids, mtp=spec.use_mtp, remat=tcfg.remat,
                                          policy=tcfg.remat_policy, chunk_size=tcfg.chunk_size)
    main, mt = lm_losses(logits, mtp_logits, ids, mask)
    loss = main + (mtp_lambda(spec.cfg, tcfg) * mt if spec.use_mtp else 0.0)
    return loss, {"ce": main, "mtp_ce": mt, "routing": routing}


def train_step(spec: StepSpec, state: dict, ids, mask) -> tuple[dict, dict]:
    """One optimizer step + expert-bias update. Returns (new state, metrics of this step).

    metrics: loss, ce, mtp_ce, grad_norm, lr (the rate this step used), load [n_moe_layers, E]
    (sorted by layer), max_load_ratio (max of load / mean load; 1 = balanced).
    """
    cfg, tcfg = spec.cfg, spec.tcfg
    tx = make_optimizer(tcfg)
    (loss, aux), grads = jax.value_and_grad(lambda p: loss_fn(spec, p, state["bias"], state["rest"], ids, mask),
                                            has_aux=True)(state["params"])
    gnorm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    loads = expert_load(aux["routing"], cfg.num_experts, mask)
    bias_layer = dict(spec.bias_layer)
    bias = dict(state["bias"])
    for layer, load in loads.items():
        k, at = bias_layer[layer]  # at: () or (g, j) of a stacked run
        bias[k] = bias[k].at[at].set(update_expert_bias(bias[k][at], load, tcfg.bias_rate))
    layers = sorted(loads)
    load_arr = jnp.stack([loads[i] for i in layers]) if layers else jnp.zeros((0, cfg.num_experts))
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])
    metrics = {"loss": loss, "ce": aux["ce"], "mtp_ce": aux["mtp_ce"], "grad_norm": gnorm,
               "lr": lr_schedule(tcfg)(state["step"]), "load": load_arr,
               "max_load_ratio": (jnp.max(load_arr) * cfg.num_experts) if layers else jnp.ones(())}
    new = {"step": state["step"] + 1, "params": params, "bias": bias, "rest": state["rest"],
           "opt_state": opt_state, "rng": rng}
    return new, metrics


def eval_loss(spec: StepSpec, params: dict, bias: dict, rest: dict, ids, mask) -> dict:
    """{loss, ce, mtp_ce} without a gradient or an update."""
    loss, aux = loss_fn(spec, params, bias, rest, ids, mask)
    return {"loss": loss, "ce": aux["ce"], "mtp_ce": aux["mtp_ce"]}


# The state is donated: the step updates it in place on the device.
jitted_train_step = jax.jit(train_step, static_argnums=0, donate_argnums=1)
jitted_eval_loss = jax.jit(eval_loss, static_argnums=0)
