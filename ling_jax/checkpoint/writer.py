"""Write a synthetic, seeded checkpoint in the release format (spec §12; FP8 layout A or B of §12.7).

The output directory looks like the Hugging Face release: `config.json` (with the release
`quantization_config` for fp8), `generation_config.json`, `model.safetensors.index.json`,
`model-0000k-of-0000N.safetensors` shards, and a small byte-level BPE tokenizer.

Tensors are generated and written one at a time, in row chunks, so memory stays bounded whatever
the config. Values are random but chosen so a forward pass is non-degenerate: linear weights
N(0, 1/fan_in) (activations stay O(1)), norm weights 1 + 0.1·N, embeddings N(0, 1), routers with a
larger gain so sigmoid scores spread, A_log = log U(1, 16), small dt_bias / expert_bias.
Each tensor has its own generator seeded by (seed, crc32(name)), so its values do not depend on
sharding, chunking or which other tensors exist (see `generate_tensor`).

Which matrices are FP8 is `layout.BF16_MATRICES[fp8_layout]` (the table `ling-jax plan` uses too);
the default stays layout B with BF16 conv taps (`layout.DEFAULT_FP8_LAYOUT`/`DEFAULT_CONV_DTYPE`).
Values do not depend on the layout: a layout-A and a layout-B checkpoint of the same seed differ
only in how MLA `kv_a_proj_with_mqa` and `g_proj` are rounded (BF16 vs FP8 blocks).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from typing import Iterator, Optional

import numpy as np

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.fp8 import DEFAULT_BLOCK, block_quant_fp8
from ling_jax.checkpoint.atomic import make_temp_dir
from ling_jax.checkpoint.safetensors_io import prepare_out_dir, replace_dir, DTYPES, ShardWriter, nbytes
from ling_jax.config import LingConfig

SHARD_TARGET_BYTES = 5_000_000_000  # default shard size (the HF "5GB" convention)
CHUNK_ELEMENTS = 1 << 23            # generate at most ~8M float32 values (32 MiB) at a time
INDEX_FILE = "model.safetensors.index.json"


def shard_file_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# values
# ---------------------------------------------------------------------------------------------
def init_distribution(name: str, spec: L.TensorSpec) -> tuple[str, float, float]:
    """(kind, a, b) of a tensor's random init: ('normal', mean, std) or ('log_uniform', lo, hi)."""
    k = spec.kind
    if k == L.EMBEDDING:
        return ("normal", 0.0, 1.0) if "word_embeddings" in name else ("normal", 0.0, 1.0 / math.sqrt(spec.shape[1]))
    if k == L.NORM:
        return ("normal", 1.0, 0.1)
    if k == L.CONV:
        return ("normal", 0.0, 1.0 / math.sqrt(spec.shape[-1]))
    if k == L.PARAM:
        if name.endswith("A_log"):
            return ("log_uniform", 1.0, 16.0)
        if name.endswith("dt_bias"):
            return ("normal", 0.0, 0.1)
        if name.endswith("expert_bias"):
            return ("normal", 0.0, 0.01)
        return ("normal", 0.0, 0.1)
    if k == L.ROUTER:
        # logits std ≈ 2 for O(1) inputs: sigmoid scores spread over roughly (0.1, 0.9)
        return ("normal", 0.0, 2.0 / math.sqrt(spec.shape[1]))
    # LINEAR. The KDA forget-gate projection gets a smaller gain: its output is multiplied by
    # exp(A_log) ∈ [1, 16] inside a sigmoid, and N(0, 1) pre-activations would saturate the gate
    # to exactly "keep" or "forget"; gain 0.25 keeps decays spread over (e^-5, 1).
    gain = 0.25 if name.endswith("attention.f_proj.weight") else 1.0
    return ("normal", 0.0, gain / math.sqrt(spec.shape[1]))


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8"))])


def _row_chunk(spec: L.TensorSpec, quantized: bool, block) -> int:
    row = max(1, math.prod(spec.shape[1:]))
    rows = max(1, CHUNK_ELEMENTS // row)
    if quantized:
        rows = max(block[0], rows // block[0] * block[0])
    return rows


def generate_chunks(name: str, spec: L.TensorSpec, seed: int, rows_per_chunk: Optional[int] = None
                    ) -> Iterator[np.ndarray]:
    """The tensor's float32 values as consecutive row chunks (identical values for any chunking)."""
    kind, a, b = init_distribution(name, spec)
    rng = _rng(seed, name)
    shape = spec.shape
    if len(shape) == 0:
        rows, rest = 1, ()
    else:
        rows, rest = shape[0], tuple(shape[1:])
    per = rows_per_chunk or rows
    row_elems = math.prod(rest)
    for r0 in range(0, rows, per):
        n = min(per, rows - r0)
        if kind == "normal":
            x = rng.standard_normal(n * row_elems, dtype=np.float32)
            x *= np.float32(b)
            if a:
                x += np.float32(a)
        elif kind == "log_uniform":
            x = np.log(np.float32(a) + np.float32(b - a) * rng.random(n * row_elems, dtype=np.float32))
        else:  # pragma: no cover
            raise AssertionError(kind)
        yield x.reshape((n,) + rest) if shape else x.reshape(())


def generate_tensor(cfg: LingConfig, name: str, seed: int = 0) -> np.ndarray:
    """The full float32 values `write_checkpoint` generates for `name` (before storage rounding)."""
    spec = L.expected_tensors(cfg).get(name)
    if spec is None:
        raise KeyError(f"{name!r} is not a tensor of this config")
    return np.concatenate(list(generate_chunks(name, spec, seed)), axis=0) if spec.shape else \
        next(generate_chunks(name, spec, seed))


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------
_CORPUS = """\
A language model reads a stream of tokens and predicts the next one. Each token is a small piece
of text: a whole word, part of a word, a space, a digit or a punctuation mark. The model turns
every token into a vector, mixes the vectors of the sequence with attention and recurrent layers,
and finally scores every entry of its vocabulary.

The river ran quietly past the old mill, where the water wheel had not turned for many years.
Children walked along the bank in the evening, counting boats and throwing small stones into the
current. On Saturdays the market filled the square with bread, apples, cheese, honey and flowers.

Numbers matter too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2025, 3.14159, 1e-6, 4096 and 128.
Lists, dates and prices (12.50, 7.99) appear in ordinary writing as often as long sentences do.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

Questions and answers: What is the capital of France? Paris. How many days are in a week? Seven.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.
The user asks, the assistant answers, and the conversation continues until the end of the text.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _special_tokens(cfg: LingConfig) -> dict[int, str]:
    """id -> content of the special tokens the config refers to (eos ids, pad, bos)."""
    sp: dict[int, str] = {}
    for j, e in enumerate(cfg.eos_token_id):
        sp.setdefault(int(e), "<|endoftext|>" if j == 0 else f"<|eos_{j}|>")
    if cfg.pad_token_id is not None:
        sp.setdefault(int(cfg.pad_token_id), "<|pad|>")
    if cfg.bos_token_id is not None:
        sp.setdefault(int(cfg.bos_token_id), "<|begin_of_text|>")
    return sp


def with_special_ids(tok, vocab_size: int, specials: dict[int, str]) -> tuple[str, list]:
    """A trained `tokenizers` BPE re-numbered so the special tokens sit at exactly the config's ids.

    Returns (tokenizer.json text, the added-token entries). Merges refer to tokens by text, so the
    BPE vocabulary can take the free ids in order.
    """
    from tokenizers import Tokenizer
    d = json.loads(tok.to_str())
    bpe = sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1])
    free = (i for i in range(vocab_size) if i not in specials)
    d["model"]["vocab"] = {t: next(free) for t, _ in bpe}
    added = []
    for i, s in sorted(specials.items()):
        d["model"]["vocab"][s] = i
        added.append({"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    d["added_tokens"] = added
    text = json.dumps(d, ensure_ascii=False)
    Tokenizer.from_str(text)  # must load
    return text, added


def build_tokenizer(cfg: LingConfig) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict): a byte-level BPE trained on a built-in text.

    The BPE vocabulary has at most 512 entries and avoids the config's special ids; the special
    tokens (eos, pad, bos) sit exactly at the ids the config names, so the model and tokenizer agree.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = _special_tokens(cfg)
    for i, s in specials.items():
        if not 0 <= i < cfg.vocab_size:
            raise ValueError(f"special token id {i} ({s}) is outside the vocabulary (vocab_size={cfg.vocab_size})")
    n_bpe = min(512, cfg.vocab_size - len(specials))
    if n_bpe < 260:
        raise ValueError(f"vocab_size={cfg.vocab_size} is too small for a byte-level tokenizer "
                         f"(needs >= {260 + len(specials)}); write without a tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    paragraphs = [p for p in _CORPUS.split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs * 4, trainer)
    text, added = with_special_ids(tok, cfg.vocab_size, specials)
    eos = specials[int(cfg.eos_token_id[0])]
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": specials[int(cfg.pad_token_id)] if cfg.pad_token_id is not None else None,
        "bos_token": specials[int(cfg.bos_token_id)] if cfg.bos_token_id is not None else None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(cfg.max_position_embeddings),
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    return text, tcfg


# ---------------------------------------------------------------------------------------------
# sharding
# ---------------------------------------------------------------------------------------------
def plan_shards(entries: list[tuple[str, str, tuple[int, ...]]], num_shards: Optional[int] = None
                ) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """Split the ordered entries into `num_shards` contiguous, non-empty, byte-balanced shards.

    A weight and its `weight_scale_inv` always share a shard (the writer streams them together).
    """
    groups: list[list] = []
    for e in entries:
        if e[0].endswith(L.SCALE_SUFFIX) and groups and L.weight_of_scale(e[0]) == groups[-1][0][0]:
            groups[-1].append(e)
        else:
            groups.append([e])
    sizes = [sum(nbytes(d, s) for _, d, s in g) for g in groups]
    total = sum(sizes)
    if num_shards is None:
        num_shards = max(2, math.ceil(total / SHARD_TARGET_BYTES))
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"num_shards must be a positive integer, got {num_shards!r}")
    num_shards = min(num_shards, len(groups))
    shards: list[list] = [[]]
    done = 0
    for i, (g, sz) in enumerate(zip(groups, sizes)):
        k = len(shards) - 1
        if shards[-1] and k < num_shards - 1:
            groups_left, shards_left = len(groups) - i, num_shards - 1 - k
            if done >= (k + 1) * total / num_shards or groups_left <= shards_left:
                shards.append([])
        shards[-1].extend(g)
        done += sz
    assert len(shards) == num_shards and all(shards)
    return shards


# ---------------------------------------------------------------------------------------------
# writer
# ---------------------------------------------------------------------------------------------
def checkpoint_config_dict(cfg: LingConfig, dtype: str = "fp8", include_mtp: bool = True,
                           fp8_layout: str = L.DEFAULT_FP8_LAYOUT) -> dict:
    """The config.json content for a checkpoint of `cfg` in `dtype` (fp8: `fp8_layout`'s
    `quantization_config.modules_to_not_convert`)."""
    d = cfg.to_dict()
    d.pop("quantization_config", None)
    for k in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        if not d.get(k):
            d.pop(k, None)  # empty = no clamp; LingConfig's parser rejects an empty list
    if not include_mtp:
        d["num_nextn_predict_layers"] = 0
    if dtype == "fp8":
        d["quantization_config"] = L.quantization_config(cfg, include_mtp, fp8_layout)
    return d


def write_generation_config(d: str, cfg: LingConfig) -> None:
    """generation_config.json with the config's eos (int or list), pad and bos ids."""
    gen = {"eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0]}
    if cfg.pad_token_id is not None:
        gen["pad_token_id"] = cfg.pad_token_id
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    _write_json(os.path.join(d, "generation_config.json"), gen)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_checkpoint(cfg: LingConfig, out_dir: str, dtype: str = "fp8", seed: int = 0,
                     num_shards: Optional[int] = None, header_only: bool = False, tokenizer: bool = True,
                     include_mtp: bool = True, overwrite: bool = False, progress: bool = True,
                     fp8_layout: str = L.DEFAULT_FP8_LAYOUT, conv_dtype: str = L.DEFAULT_CONV_DTYPE) -> dict:
    """Write a seeded random checkpoint of `cfg` to `out_dir`; returns a summary dict.

    dtype: 'fp8' (FP8 E4M3 + float32 block scales) or 'bf16' (no quantization).
    fp8_layout: which matrices fp8 keeps BF16 (spec §12.7, `layout.BF16_MATRICES`): 'B' (default:
    KDA b_proj + MLA head-wise g_proj, the spec's preferred layout and the one the release config's
    modules_to_not_convert encodes) or 'A' (KDA b_proj + MLA kv_a_proj_with_mqa; with
    conv_dtype='F32' its byte total is the published 534.35 GiB). Ignored for dtype='bf16'.
    conv_dtype: storage dtype of the KDA conv taps, 'BF16' (default, unchanged behaviour) or 'F32'
    (the spec leaves it open).
    header_only: write shard headers and the index with the real shapes and offsets but no tensor
    bytes (each shard is truncated right after its header and marked in its metadata).
    Everything is written into a temporary directory next to `out_dir` and renamed into place at
    the end, so a failure never leaves a half-written checkpoint.
    """
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"dtype must be 'fp8' or 'bf16', got {dtype!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    for i in (*cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id):
        if i is not None and not 0 <= int(i) < cfg.vocab_size:
            raise ValueError(f"special token id {i} is not a valid id for vocab_size={cfg.vocab_size}")
    fp8_layout = L.check_fp8_layout(fp8_layout)
    conv_dtype = L.check_conv_dtype(conv_dtype)
    out_dir, parent = prepare_out_dir(out_dir, overwrite)
    block = tuple(cfg.weight_block_size or DEFAULT_BLOCK)
    specs = L.expected_tensors(cfg, include_mtp, conv_dtype, fp8_layout)
    entries = L.release_tensors(cfg, dtype, include_mtp, conv_dtype, block, fp8_layout)
    shards = plan_shards(entries, num_shards)
    n = len(shards)
    total = sum(nbytes(d, s) for _, d, s in entries)
    tok = build_tokenizer(cfg) if tokenizer else None  # fails early on a too-small vocabulary

    tmp = make_temp_dir(out_dir)  # hidden .ling-tmp-* name; cleaned by the next run if we are killed
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0700; a checkpoint is a normal directory
        weight_map: dict[str, str] = {}
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing checkpoint",
                   disable=not progress or header_only, leave=False)
        try:
            for k, shard in enumerate(shards, 1):
                fname = shard_file_name(k, n)
                with ShardWriter(os.path.join(tmp, fname), shard, {"format": "pt"}, header_only) as w:
                    for name, _, _ in shard:
                        weight_map[name] = fname
                    if header_only:
                        continue
                    for name, dt, shape in shard:
                        if name.endswith(L.SCALE_SUFFIX):
                            continue  # written together with its weight
                        _write_tensor(w, name, dt, specs[name], seed, block, bar)
        finally:
            bar.close()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        if header_only:
            index["metadata"]["ling_jax_header_only"] = True
        _write_json(os.path.join(tmp, INDEX_FILE), index)
        _write_json(os.path.join(tmp, "config.json"), checkpoint_config_dict(cfg, dtype, include_mtp, fp8_layout))
        write_generation_config(tmp, cfg)
        if tok is not None:
            text, tcfg = tok
            with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
                f.write(text)
            _write_json(os.path.join(tmp, "tokenizer_config.json"), tcfg)
        # move into place
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out_dir": out_dir, "num_tensors": len(entries), "total_size": total, "num_shards": n,
            "dtype": dtype, "header_only": header_only,
            "fp8_layout": fp8_layout if dtype == "fp8" else None, "conv_dtype": conv_dtype}


def _write_tensor(w: ShardWriter, name: str, dt: str, spec: L.TensorSpec, seed: int, block, bar) -> None:
    if dt == "F8_E4M3":
        scales = []
        for chunk in generate_chunks(name, spec, seed, _row_chunk(spec, True, block)):
            wq, s = block_quant_fp8(chunk, block)
            w.write(name, wq)
            scales.append(s)
            bar.update(wq.nbytes)
        s = np.concatenate(scales, axis=0)
        w.write(L.scale_name(name), s)
        bar.update(s.nbytes)
    else:
        for chunk in generate_chunks(name, spec, seed, _row_chunk(spec, False, block)):
            c = chunk.astype(DTYPES[dt])
            w.write(name, c)
            bar.update(c.nbytes)


def tiny_config(**overrides) -> LingConfig:
    """A small valid config for tests and demos (9 layers: KDA 0-6, MLA 7, trailing-group MLA 8;
    widths deliberately not multiples of 128; 8 experts in 4 groups). `overrides` are config.json
    fields; the SwiGLU limit lists are resized to num_hidden_layers (clamp on the last layers)."""
    n = int(overrides.get("num_hidden_layers", 9))
    d = {
        "model_type": "bailing_hybrid", "vocab_size": 512, "hidden_size": 192, "num_hidden_layers": n,
        "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 320,
        "rms_norm_eps": 1e-6, "pad_token_id": 510, "eos_token_id": 511, "layer_group_size": 8,
        "first_k_dense_replace": min(2, max(n - 1, 0)), "num_nextn_predict_layers": 1, "short_conv_kernel_size": 4,
        "kda_lower_bound": -5.0, "q_lora_rank": 96, "kv_lora_rank": 48, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "rope_theta": 6e6, "max_position_embeddings": 4096,
        "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 96,
        "moe_shared_expert_intermediate_size": 96, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    }
    d.update(overrides)
    n = d["num_hidden_layers"]
    d.setdefault("expert_swiglu_limit_list", [0.0] * max(n - 1, 0) + [4.0] * min(1, n))
    d.setdefault("share_expert_swiglu_limit_list", [0.0] * max(n - 2, 0) + [5.0] * min(1, max(n - 1, 0)) + [7.0] * min(1, n))
    return LingConfig.from_dict(d, "tiny_config")
