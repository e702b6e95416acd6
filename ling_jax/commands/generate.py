"""`ling-jax generate`: text or token continuation from a checkpoint (CLI contract of issue 3)."""
from __future__ import annotations

import json
import sys

from ling_jax.checks import check_int
from ling_jax.commands.common import (add_kernel_flags, add_long_context_flag, add_value_check_flag,
                                      apply_value_check_flag, check_cache_fits, check_context_length, check_ids,
                                      checkpoint_config, finite_float, generate_cache_bytes, non_negative_float,
                                      non_negative_int, parse_ids, positive_int)


def add_parser(sub):
    p = sub.add_parser("generate", help="generate a continuation of --prompt or --input-ids")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (HF release layout)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the checkpoint)")
    src.add_argument("--input-ids", help="comma-separated prompt token ids")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=positive_int, required=True)
    p.add_argument("--greedy", action="store_true", help="greedy decoding (the default without --temperature)")
    p.add_argument("--temperature", type=non_negative_float, default=None, help="finite, >= 0 (0 = greedy)")
    p.add_argument("--top-p", type=non_negative_float, default=1.0, help="nucleus threshold in (0, 1]")
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--seed", type=int, default=0)
    add_penalty_flags(p)
    p.add_argument("--logprobs", type=non_negative_int, default=None, metavar="N",
                   help="with --json: each new token's logprob and the top N (<= 20) alternatives, of the "
                        "model's raw distribution (before penalties, temperature, top-k, top-p)")
    p.add_argument("--speculative", type=int, default=0, metavar="K", help="MTP drafts per step (1..3)")
    p.add_argument("--stop-ids", default=None, help="comma-separated stop token ids (default: EOS ids)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    add_kernel_flags(p)
    p.add_argument("--mesh", default=None, help="device mesh, e.g. expert=4,model=2")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="MLA latent cache storage: auto (the model dtype) or fp8 (float8_e4m3fn + a float32 scale "
                        "per token: half the bytes of bfloat16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_long_context_flag(p)
    add_value_check_flag(p)
    from sharding import add_distributed_args
    add_distributed_args(p)
    return p


def add_penalty_flags(p, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> None:
    """--presence-penalty / --frequency-penalty (OpenAI semantics, [-2, 2]) and --repetition-penalty
    (HF semantics, > 0, 1 = off); the defaults are the caller's (the demo's differ)."""
    p.add_argument("--presence-penalty", type=finite_float, default=presence,
                   help=f"in [-2, 2]: subtracted from the logit of every token generated so far (default {presence})")
    p.add_argument("--frequency-penalty", type=finite_float, default=frequency,
                   help=f"in [-2, 2]: times each token's count among the generated tokens, subtracted "
                        f"(default {frequency})")
    p.add_argument("--repetition-penalty", type=finite_float, default=repetition,
                   help=f"> 0 (1 = off): logits of prompt and generated tokens divided (positive) or "
                        f"multiplied (negative) by it (default {repetition})")


def _default_dtype() -> str:
    from ling_jax.ops import default_dtype
    return default_dtype()


def jax_process_count() -> int:
    import jax
    return jax.process_count()


def run(args) -> int:
    from ling_jax.generate import cache_length, generate
    from ling_jax.commands.common import load_for_args
    from ling_jax.sampling import SamplingParams
    from ling_jax.tokenizer import Tokenizer, eos_token_ids, load_generation_config

    check_int(args.max_new_tokens, "--max-new-tokens", low=1, expected=">= 1")
    check_int(args.speculative, "--speculative", low=0, high=3, expected="0..3")
    if args.greedy and args.temperature not in (None, 0.0):
        raise ValueError("--greedy and --temperature > 0 contradict each other")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    cfg = checkpoint_config(args.checkpoint)
    stop = None
    if args.stop_ids is not None:
        stop = parse_ids(args.stop_ids, "--stop-ids")
        check_ids(stop, cfg, "--stop-ids")
    tok = Tokenizer.from_dir(args.checkpoint)
    if args.prompt is not None:
        if tok is None:
            raise ValueError(f"--prompt needs a tokenizer, but {args.checkpoint} has no tokenizer.json "
                             "(use --input-ids)")
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
        ids = tok.encode(text, add_special_tokens=True)
        if not ids:
            raise ValueError("--prompt: empty prompt (it encodes to no tokens)")
    else:
        ids = parse_ids(args.input_ids)
    check_ids(ids, cfg, "--prompt" if args.prompt is not None else "--input-ids")
    total = len(ids) + args.max_new_tokens
    dtype_bytes = 4 if (args.dtype or _default_dtype()) == "float32" else 2
    kv = args.kv_cache_dtype
    need = generate_cache_bytes(cfg, 1, cache_length(len(ids), args.max_new_tokens, args.speculative),
                                dtype_bytes, args.speculative > 0, kv)  # what generate() allocates
    check_cache_fits(need, f"--max-new-tokens {args.max_new_tokens}")  # before anything is allocated
    check_context_length(total, cfg, args.allow_long_context, "--max-new-tokens")
    apply_value_check_flag(args)
    try:
        sampling = SamplingParams(temperature=args.temperature or 0.0, top_k=args.top_k, top_p=args.top_p,
                                  seed=args.seed, presence_penalty=args.presence_penalty,
                                  frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        raise ValueError(f"--{str(e).split(' ')[0].replace('_', '-')}: {e}") from None
    if args.logprobs is not None and not args.json:
        raise ValueError("--logprobs needs --json (the values are printed in the JSON object)")
    if args.logprobs is not None and args.logprobs > 20:
        raise ValueError(f"--logprobs must be <= 20, got {args.logprobs}")
    if args.speculative and sampling.penalized:
        raise ValueError("--presence-penalty / --frequency-penalty / --repetition-penalty do not combine with "
                         "--speculative")
    model, mesh, ex = load_for_args(args, with_mtp=args.speculative > 0)
    if mesh is not None and jax_process_count() > 1:
        raise ValueError("--mesh: generate runs sharded within one process (use `logits` for multi-process runs)")
    if args.speculative and model.mtp is None:
        raise ValueError(f"--speculative: {args.checkpoint} has no MTP layer")
    if stop is None:
        stop = eos_token_ids(load_generation_config(args.checkpoint), tok) or list(model.cfg.eos_token_id)
    stream = None
    if not args.json and tok is not None:
        stream = _Printer(tok)
    res = generate(model, [ids], args.max_new_tokens, sampling=sampling, speculative=args.speculative,
                   stop_ids=stop, stream=stream, kv_cache_dtype=kv, logprobs=args.logprobs, exec=ex)
    new = res.tokens[0]
    if args.json:
        out = {"token_ids": new}
        if tok is not None:
            out["text"] = tok.decode(new)
        if args.speculative:
            out["acceptance_length"] = res.acceptance_length
        if args.logprobs is not None:
            out["logprobs"] = [{"logprob": t.logprob, "top": [[i, v] for i, v in t.top]} for t in res.logprobs[0]]
        print(json.dumps(out))
    elif tok is None:
        print(",".join(map(str, new)))
    else:
        stream.finish()
        if args.speculative:
            print(f"[mean acceptance length {res.acceptance_length:.2f}]", file=sys.stderr)
    return 0


class _Printer:
    """Streams decoded text as tokens arrive (decoding the whole prefix keeps multi-byte text intact)."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], ""

    def __call__(self, toks, counts):
        self.ids.extend(int(t) for t in toks[0, :int(counts[0])])
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text

    def finish(self):
        text = self.tok.decode(self.ids)
        sys.stdout.write(text[len(self.shown):] + "\n")
        sys.stdout.flush()
