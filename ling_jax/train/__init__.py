"""Training a Ling model from scratch: next-token + MTP loss, AdamW, remat, aux-loss-free balancing.

  config.py          TrainConfig (hyper-parameters), mtp_lambda
  data.py            text files → packed token stream → batches (read_corpus, corpus_tokens, BatchStream)
  tokenizer_train.py train_tokenizer (byte-level BPE on the corpus, special ids from the config)
  model_init.py      default_model_config, init_model
  flat.py            the model as flat string-keyed dicts (params / expert_bias / rest)
  step.py            forward, losses, optimizer, the pure train_step / eval_loss (StepSpec)
  loop.py            Trainer: the state and the jitted step
  state.py           Orbax CheckpointManager save / restore, load_trained_model
"""
from ling_jax.train.config import TrainConfig, mtp_lambda
from ling_jax.train.data import BatchStream, corpus_tokens, pack_documents, read_corpus
from ling_jax.train.flat import BIAS_NAME, bias_layers, flatten_state, merge_model, split_model, unflatten
from ling_jax.train.loop import Trainer
from ling_jax.train.model_init import default_model_config, init_model
from ling_jax.train.state import checkpoint_manager, load_trained_model, read_meta, restore_state, save_state
from ling_jax.train.step import (StepSpec, cross_entropy, eval_loss, expert_load, forward, initial_state,
                                 jitted_eval_loss, jitted_train_step, lm_losses, loss_fn, lr_schedule,
                                 make_optimizer, train_step, update_expert_bias)
from ling_jax.train.tokenizer_train import train_tokenizer

__all__ = [
    "BIAS_NAME", "BatchStream", "StepSpec", "TrainConfig", "Trainer", "bias_layers", "checkpoint_manager",
    "corpus_tokens", "cross_entropy", "default_model_config", "eval_loss", "expert_load", "flatten_state",
    "forward", "init_model", "initial_state", "jitted_eval_loss", "jitted_train_step", "lm_losses",
    "load_trained_model", "loss_fn", "lr_schedule", "make_optimizer", "merge_model", "mtp_lambda",
    "pack_documents", "read_corpus", "read_meta", "restore_state", "save_state", "split_model", "train_step",
    "train_tokenizer", "unflatten", "update_expert_bias",
]
