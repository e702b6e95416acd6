"""`TrainConfig`: every training hyper-parameter, and the MTP loss weight it implies.

Frozen (hence hashable) because it is part of the static `StepSpec` of the jitted train step: two
trainers with equal settings share one compilation.
"""
from __future__ import annotations

import dataclasses

from ling_jax.config import LingConfig


@dataclasses.dataclass(frozen=True)
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
    """λ of the MTP loss term: the config's `mtp_loss_scaling_factor`, or `tcfg.mtp_weight` when the
    config leaves it at 0 (released configs omit it)."""
    return float(cfg.mtp_loss_scaling_factor) if cfg.mtp_loss_scaling_factor else float(tcfg.mtp_weight)
