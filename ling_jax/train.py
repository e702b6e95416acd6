"""Training: next-token + MTP loss, AdamW, remat per decoder layer, aux-loss-free MoE balancing.

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

State is a plain pytree of string-keyed flat dicts (`TrainState`), so Orbax saves it as is and the
step is one `jax.jit` over it; parameters keep whatever sharding they were placed with (pass a mesh
and the batch is split over its `data` axis).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ling_jax.config import KDA, LingConfig
from ling_jax.kda import kda_zero_state
from ling_jax.loader import abstract_model
from ling_jax.model import LingForCausalLM

BIAS_NAME = "expert_bias"


@dataclasses.dataclass
class TrainConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1           # cosine decays to lr * min_lr_ratio at total_steps
    warmup_steps: int = 100
    total_steps: int = 1000
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    mtp: bool = True                    # train the MTP head (if the model has one)
    mtp_weight: float = 0.3             # λ when cfg.mtp_loss_scaling_factor == 0
    remat: bool = False                 # rematerialise every decoder layer (and the MTP layer)
    remat_policy: str = "nothing_saveable"  # a jax.checkpoint_policies name
    bias_rate: float = 1e-3             # expert_bias update speed (DeepSeek-V3: 1e-3)
    chunk_size: int = 16                # KDA chunk length: on CPU the backward of 16 is 2.3× faster than 64
    seed: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def mtp_lambda(cfg: LingConfig, tcfg: TrainConfig) -> float:
    return float(cfg.mtp_loss_scaling_factor) if cfg.mtp_loss_scaling_factor else float(tcfg.mtp_weight)


# ---------------------------------------------------------------------------------------------
# optimizer
# ---------------------------------------------------------------------------------------------
def lr_schedule(tcfg: TrainConfig):
    warm = max(0, int(tcfg.warmup_steps))
    total = max(int(tcfg.total_steps), warm + 1)
    return optax.warmup_cosine_decay_schedule(0.0, tcfg.lr, warm, total, end_value=tcfg.lr * tcfg.min_lr_ratio)


def _decay(key: str, leaf) -> bool:
    return leaf.ndim >= 2 and not key.endswith("conv1d")


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    mask = lambda params: {k: _decay(k, v) for k, v in params.items()}  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(tcfg.clip_norm),
        optax.adamw(lr_schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps, weight_decay=tcfg.weight_decay,
                    mask=mask),
    )


# ---------------------------------------------------------------------------------------------
# model <-> flat string-keyed dicts
# ---------------------------------------------------------------------------------------------
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains(BIAS_NAME)))
BIAS = nnx.All(nnx.Param, nnx.PathContains(BIAS_NAME))


def _key(path) -> str:
    return "/".join(str(p) for p in path)


def flatten_state(state) -> tuple[dict, dict]:
    """nnx.State → ({'a/b/0/c': array}, {'a/b/0/c': path tuple})."""
    flat, paths = {}, {}
    for path, var in nnx.to_flat_state(state):
        k = _key(path)
        flat[k] = var.get_value() if hasattr(var, "get_value") else var
        paths[k] = tuple(path)
    return flat, paths


def unflatten(flat: dict, paths: dict) -> dict:
    """Flat dict → the nested pure dict `nnx.merge` accepts."""
    out: dict = {}
    for k, v in flat.items():
        d = out
        p = paths[k]
        for q in p[:-1]:
            d = d.setdefault(q, {})
        d[p[-1]] = v
    return out


def split_model(model: LingForCausalLM):
    """(graphdef, params, bias, rest, paths): params/bias/rest are flat dicts; paths maps every key."""
    graphdef, p, b, r = nnx.split(model, TRAINABLE, BIAS, ...)
    params, pp = flatten_state(p)
    bias, bp = flatten_state(b)
    rest, rp = flatten_state(r)
    return graphdef, params, bias, rest, {**pp, **bp, **rp}


def bias_layers(cfg: LingConfig, bias_keys: Iterable[str]) -> dict[int, str]:
    """Decoder layer index (num_hidden_layers for MTP) → its expert_bias key."""
    out = {}
    for k in bias_keys:
        p = k.split("/")
        out[cfg.num_hidden_layers if p[0] == "mtp" else int(p[2])] = k
    return out


# ---------------------------------------------------------------------------------------------
# forward and loss
# ---------------------------------------------------------------------------------------------
def forward(model: LingForCausalLM, ids, *, mtp: bool, remat: bool = False, policy: str = "nothing_saveable",
            chunk_size: int = 64):
    """Cache-free training forward. Returns (logits [B,T,V], mtp_logits or None, routing {layer: [B,T,k]}).

    Without remat this is `model(ids, mtp=mtp)`. With remat the same layer scans as the model's
    (`layer_stack`) run every decoder layer body under `jax.checkpoint(policy)`, so the backward
    pass keeps only each layer's input; the MTP layer is checkpointed the same way.
    """
    from ling_jax.layer_stack import layer_plan, per_layer, stack_params

    opts = {"kda_mode": "chunk", "chunk_size": chunk_size}
    if not remat:
        out = model(ids, mtp=mtp, opts=opts)
        return out["logits"], out.get("mtp_logits"), out["routing"]
    cfg = model.cfg
    pol = getattr(jax.checkpoint_policies, policy)
    B, T = ids.shape
    n_valid = jnp.full((B,), T, jnp.int32)
    lengths = jnp.zeros((B,), jnp.int32)

    def zero_kda(block, r):
        lead = (block.repeats, block.runs[r].n)
        return jax.tree.map(lambda x: jnp.broadcast_to(x, lead + x.shape), kda_zero_state(cfg, B, model.dtype))

    h = model.model.word_embeddings(ids).astype(model.dtype)
    routing = {}
    for block in layer_plan(cfg):
        stacked = stack_params(model.model.layers, block)
        caches = tuple(zero_kda(block, r) if run.attn == KDA else None for r, run in enumerate(block.runs))

        def group_body(h, xs, stacked=stacked):
            params_g, caches_g = xs
            idxs = []
            for r, (gdef, _) in enumerate(stacked):
                def layer_body(h, ys, gdef=gdef):
                    p, c = ys
                    h, _, idx, _ = nnx.merge(gdef, p)(h, c, lengths, n_valid, opts, None)
                    return h, idx
                h, idx = jax.lax.scan(jax.checkpoint(layer_body, policy=pol), h, (params_g[r], caches_g[r]))
                idxs.append(idx)
            return h, tuple(idxs)

        h, idxs = jax.lax.scan(group_body, h, (tuple(p for _, p in stacked), caches))
        for r in range(len(block.runs)):
            if idxs[r] is not None:
                routing.update(per_layer(block, r, idxs[r]))
    z = model.model.norm(h)
    logits = model.logits(z)
    mtp_logits = None
    if mtp:
        nxt = jnp.concatenate([ids[:, 1:], jnp.zeros((B, 1), ids.dtype)], axis=1)
        emb = model.model.word_embeddings(nxt).astype(model.dtype)
        gd, st = nnx.split(model.mtp)

        def mtp_fn(st, emb, z):
            zm, _, idx = nnx.merge(gd, st)(emb, z, None, lengths, n_valid, opts, None)
            return zm, idx

        zm, idx = jax.checkpoint(mtp_fn, policy=pol)(st, emb, z)
        routing[cfg.num_hidden_layers] = idx
        mtp_logits = model.logits(zm)
    return logits, mtp_logits, routing


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
        if mask is None:
            w = jnp.ones(idx.shape, jnp.float32)
        else:
            w = jnp.broadcast_to(mask[..., None], idx.shape).astype(jnp.float32)
        counts = jnp.zeros((num_experts,), jnp.float32).at[idx.reshape(-1)].add(w.reshape(-1))
        out[layer] = counts / jnp.maximum(counts.sum(), 1.0)
    return out


def update_expert_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3 aux-loss-free rule: `bias += rate · sign(mean_load − load)` (float32)."""
    return (bias.astype(jnp.float32) + rate * jnp.sign(jnp.mean(load) - load)).astype(bias.dtype)


# ---------------------------------------------------------------------------------------------
# trainer
# ---------------------------------------------------------------------------------------------
_COMPILED: dict = {}


class Trainer:
    """Holds the train state and the jitted step.

    `state` = {step, params, bias, rest, opt_state, rng}: params/bias/rest are flat dicts keyed
    'model/layers/0/attention/q_proj/weight' etc.; rng is raw uint32 key data.
    """

    def __init__(self, model: LingForCausalLM, tcfg: TrainConfig | None = None, mesh=None):
        self.cfg: LingConfig = model.cfg
        self.tcfg = tcfg or TrainConfig()
        self.mesh = mesh
        self.graphdef, params, bias, rest, self.paths = split_model(model)
        self.bias_layer = bias_layers(self.cfg, bias.keys())
        self.has_mtp = model.mtp is not None
        self.use_mtp = bool(self.tcfg.mtp and self.has_mtp)
        self.mtp_lambda = mtp_lambda(self.cfg, self.tcfg)
        self.tx = make_optimizer(self.tcfg)
        self.schedule = lr_schedule(self.tcfg)
        self.state = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "bias": bias,
            "rest": rest,
            "opt_state": jax.jit(self.tx.init)(params),
            "rng": jax.random.key_data(jax.random.key(self.tcfg.seed)),
        }
        # Commit every array to its device(s): restored (Orbax) arrays are committed, and the step
        # must see the same input shardings before and after a restore to reuse its compilation.
        self.state = jax.tree.map(lambda a: a if getattr(a, "committed", True) else jax.device_put(a, a.sharding),
                                  self.state)
        # Trainers of the same structure and settings share compiled steps (resume in-process, tests).
        key = (self.graphdef, tuple(sorted(self.paths.items())), self.cfg, dataclasses.astuple(self.tcfg),
               self.use_mtp)
        if key not in _COMPILED:
            _COMPILED[key] = (jax.jit(self._train_step, donate_argnums=(0,)), jax.jit(self._eval_loss))
        self._step, self._eval = _COMPILED[key]

    # ---- model views --------------------------------------------------------------------------
    def merge(self, params, bias, rest) -> LingForCausalLM:
        return nnx.merge(self.graphdef, unflatten(params, self.paths), unflatten(bias, self.paths),
                         unflatten(rest, self.paths))

    def model(self) -> LingForCausalLM:
        """The current model (shares the state's arrays)."""
        s = self.state
        return self.merge(s["params"], s["bias"], s["rest"])

    # ---- loss and step ------------------------------------------------------------------------
    def _loss(self, params, bias, rest, ids, mask):
        model = self.merge(params, bias, rest)
        logits, mtp_logits, routing = forward(model, ids, mtp=self.use_mtp, remat=self.tcfg.remat,
                                              policy=self.tcfg.remat_policy, chunk_size=self.tcfg.chunk_size)
        main, mt = lm_losses(logits, mtp_logits, ids, mask)
        loss = main + (self.mtp_lambda * mt if self.use_mtp else 0.0)
        return loss, {"ce": main, "mtp_ce": mt, "routing": routing}

    def _place_batch(self, ids):
        ids = jnp.asarray(ids, jnp.int32)
        if self.mesh is not None and "data" in self.mesh.axis_names:
            from jax.sharding import NamedSharding, PartitionSpec as P
            n = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))["data"]
            if ids.shape[0] % n == 0:
                ids = jax.device_put(ids, NamedSharding(self.mesh, P("data", None)))
        return ids

    def _train_step(self, state, ids, mask):
        (loss, aux), grads = jax.value_and_grad(self._loss, has_aux=True)(
            state["params"], state["bias"], state["rest"], ids, mask)
        gnorm = optax.tree.norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        loads = expert_load(aux["routing"], self.cfg.num_experts, mask)
        bias = dict(state["bias"])
        for layer, load in loads.items():
            k = self.bias_layer[layer]
            bias[k] = update_expert_bias(bias[k], load, self.tcfg.bias_rate)
        layers = sorted(loads)
        load_arr = jnp.stack([loads[i] for i in layers]) if layers else jnp.zeros((0, self.cfg.num_experts))
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])
        metrics = {"loss": loss, "ce": aux["ce"], "mtp_ce": aux["mtp_ce"], "grad_norm": gnorm,
                   "lr": self.schedule(state["step"]), "load": load_arr,
                   "max_load_ratio": (jnp.max(load_arr) * self.cfg.num_experts) if layers else jnp.ones(())}
        new = {"step": state["step"] + 1, "params": params, "bias": bias, "rest": state["rest"],
               "opt_state": opt_state, "rng": rng}
        return new, metrics

    def _eval_loss(self, params, bias, rest, ids, mask):
        loss, aux = self._loss(params, bias, rest, ids, mask)
        return {"loss": loss, "ce": aux["ce"], "mtp_ce": aux["mtp_ce"]}

    def train_step(self, ids, mask=None) -> dict:
        """One optimizer step on ids [B,T] (mask [B,T] marks real tokens; default all).

        Returns metrics as Python floats plus 'load' [n_moe_layers, E] (numpy): loss, ce, mtp_ce,
        grad_norm, lr (the rate used by this step), max_load_ratio (max over layers and experts
        of load / mean load; 1 = perfectly balanced).
        """
        ids = self._place_batch(ids)
        mask = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask, bool)
        self.state, m = self._step(self.state, ids, mask)
        return {k: (np.asarray(v) if k == "load" else float(v)) for k, v in m.items()}

    def eval_loss(self, ids, mask=None) -> dict:
        ids = self._place_batch(ids)
        mask = jnp.ones(ids.shape, bool) if mask is None else jnp.asarray(mask, bool)
        s = self.state
        return {k: float(v) for k, v in self._eval(s["params"], s["bias"], s["rest"], ids, mask).items()}

    @property
    def step(self) -> int:
        return int(self.state["step"])


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------
def pack_documents(docs: Iterable[list[int]], eos_id: int) -> np.ndarray:
    """Concatenate token lists, each followed by EOS, into one int32 stream."""
    parts = []
    for d in docs:
        parts.append(np.asarray(d, np.int32))
        parts.append(np.asarray([eos_id], np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


class BatchStream:
    """Batches of non-overlapping `seq`-token windows of a packed stream, reshuffled every epoch.

    Deterministic in (seed, epoch); `position()` / `set_position()` give the exact resume point.
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0):
        self.tokens = np.asarray(tokens, np.int32)
        self.batch, self.seq, self.seed = int(batch), int(seq), int(seed)
        self.n_windows = len(self.tokens) // self.seq
        if self.n_windows < 1:
            raise ValueError(f"corpus has {len(self.tokens)} tokens: fewer than one window of --seq {seq}")
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def position(self) -> dict:
        return {"epoch": int(self.epoch), "index": int(self.index)}

    def set_position(self, pos: dict) -> None:
        self.epoch, self.index = int(pos["epoch"]), int(pos["index"])
        self._order = self._perm(self.epoch)

    def next(self) -> np.ndarray:
        rows = []
        for _ in range(self.batch):
            if self.index >= self.n_windows:
                self.epoch += 1
                self.index = 0
                self._order = self._perm(self.epoch)
            w = self._order[self.index]
            self.index += 1
            rows.append(self.tokens[w * self.seq:(w + 1) * self.seq])
        return np.stack(rows)


# ---------------------------------------------------------------------------------------------
# Orbax checkpoints
# ---------------------------------------------------------------------------------------------
def checkpoint_manager(directory: str, max_to_keep: int = 3):
    """An Orbax CheckpointManager over `directory` (created if missing); `save_state` decides when to save."""
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts)


def save_state(mngr, trainer: Trainer, data_position: Optional[dict] = None, every: int = 1, force: bool = False,
               extra: Optional[dict] = None) -> bool:
    """Save the train state + JSON metadata (model config, train config, data position) at the
    trainer's current step when it is a multiple of `every` (or `force`). Asynchronous: call
    `mngr.wait_until_finished()` before reading it back."""
    import orbax.checkpoint as ocp

    step = trainer.step
    if not force and (every <= 0 or step % every):
        return False
    if step in mngr.all_steps():
        return False
    meta = {"step": step, "model_config": trainer.cfg.to_dict(), "train_config": trainer.tcfg.to_dict(),
            "data_position": data_position, "with_mtp": trainer.has_mtp, **(extra or {})}
    return mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(trainer.state),
                                                   meta=ocp.args.JsonSave(meta)), force=True)


def restore_state(mngr, trainer: Trainer, step: Optional[int] = None) -> dict:
    """Restore into `trainer` (same model config); returns the saved metadata."""
    import orbax.checkpoint as ocp

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
    import orbax.checkpoint as ocp

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
    import orbax.checkpoint as ocp

    mngr = checkpoint_manager(directory)
    tx = make_optimizer(tcfg)
    abstract = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "bias": bias, "rest": rest,
                "opt_state": jax.eval_shape(tx.init, params),
                "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))}
    r = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    return nnx.merge(graphdef, unflatten(r["params"], paths), unflatten(r["bias"], paths), unflatten(r["rest"], paths))


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------
def train_tokenizer(texts: Iterable[str], cfg: LingConfig, min_frequency: int = 2) -> tuple[str, dict]:
    """Byte-level BPE trained on `texts` with `cfg.vocab_size` ids in total.

    The special tokens sit at the ids the config names (eos → `<|endoftext|>`, pad → `<|pad|>`,
    bos → `<|begin_of_text|>`); the BPE vocabulary fills the other ids in order.
    Returns (tokenizer.json text, tokenizer_config.json dict).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials: dict[int, str] = {}
    for j, e in enumerate(cfg.eos_token_id):
        specials.setdefault(int(e), "<|endoftext|>" if j == 0 else f"<|eos_{j}|>")
    if cfg.pad_token_id is not None:
        specials.setdefault(int(cfg.pad_token_id), "<|pad|>")
    if cfg.bos_token_id is not None:
        specials.setdefault(int(cfg.bos_token_id), "<|begin_of_text|>")
    for i, s in specials.items():
        if not 0 <= i < cfg.vocab_size:
            raise ValueError(f"special token id {i} ({s}) is outside vocab_size={cfg.vocab_size}")
    n_bpe = cfg.vocab_size - len(specials)
    if n_bpe < 256:
        raise ValueError(f"vocab_size={cfg.vocab_size} is too small for a byte-level BPE (needs >= {256 + len(specials)})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    from ling_jax.checkpoint.writer import with_special_ids
    text, added = with_special_ids(tok, cfg.vocab_size, specials)
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": specials[int(cfg.eos_token_id[0])],
        "pad_token": specials.get(cfg.pad_token_id) if cfg.pad_token_id is not None else None,
        "bos_token": specials.get(cfg.bos_token_id) if cfg.bos_token_id is not None else None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": int(cfg.max_position_embeddings),
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    return text, tcfg


def save_tokenizer(out_dir: str, tok: tuple[str, dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    text, tcfg = tok
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)
        f.write("\n")


def default_model_config(vocab_size: int = 4096) -> LingConfig:
    """The small model `ling-jax train` builds without --config (the shipped demo model's shape).

    Every architectural feature is on while a CPU step stays ~1.6 s at 16×128 tokens: 6 layers in
    groups of 4 ([KDA KDA KDA MLA][MLA MLA]: the incomplete trailing group is all MLA, as in the
    spec's rule), layer 0 dense, 8 experts top-2 with grouped routing (4 groups, keep 2) and a
    shared expert, the SwiGLU clamp on the last layer, and an MTP layer: 4.3M parameters (2.1M of
    them embedding and head) at vocab 4096.
    """
    n = 6
    d = {
        "model_type": "bailing_hybrid", "vocab_size": vocab_size, "hidden_size": 128, "num_hidden_layers": n,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
        "rms_norm_eps": 1e-6, "pad_token_id": vocab_size - 2, "eos_token_id": vocab_size - 1,
        "layer_group_size": 4, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
        "short_conv_kernel_size": 4, "kda_lower_bound": -5.0, "q_lora_rank": 64, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 128, "moe_shared_expert_intermediate_size": 128, "n_group": 4,
        "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "expert_swiglu_limit_list": [0.0] * (n - 1) + [7.0],
        "share_expert_swiglu_limit_list": [0.0] * (n - 1) + [7.0],
    }
    return LingConfig.from_dict(d, "default_model_config")


def init_model(cfg: LingConfig, seed: int = 0, dtype=jnp.float32, with_mtp: bool = True) -> LingForCausalLM:
    """A freshly initialised model (the module initialisers) for training from scratch."""
    return LingForCausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed), with_mtp=with_mtp)
