"""What a `--checkpoint` names: a local directory, `demo` (the shipped demo model) or a Hugging
Face Hub id `ORG/NAME[@REVISION]`, resolved to a local directory.

    path = resolve_checkpoint("inclusionAI/Ling-3.1-flash@main")   # downloads into the HF cache
    path = resolve_checkpoint("demo")                              # ling_jax/demo_model

Order (the first that applies):
  1. an existing local directory of that spelling wins (`runs/demo` is a folder, not a Hub id;
     `./demo` names a folder called demo);
  2. `demo`: the demo model shipped in `ling_jax/demo_model/` (a stripped install: a random-weight
     checkpoint with the same features, written once into $LING_JAX_CACHE or ~/.cache/ling-jax);
  3. `ORG/NAME` or `ORG/NAME@REVISION` (a branch, tag or commit): `huggingface_hub.snapshot_download`
     into its cache (`HF_HOME`, `HF_HUB_CACHE`; `HF_ENDPOINT` for another endpoint, `HF_TOKEN` for
     private repositories). First the small files (config.json, generation_config.json, the index,
     tokenizer.json, tokenizer_config.json, chat_template.jinja), then the shards the index names
     (`weights=False`: none; a checkpoint without index: model.safetensors), with huggingface_hub's
     progress bars on stderr. `HF_HUB_OFFLINE=1` resolves from the cache alone; what the cache does
     not hold is then a one-line error naming the id and the cache folder.
  Anything else is returned unchanged (the command's own check then says "directory not found").
"""
from __future__ import annotations

import json
import os
import re
import sys

DEMO = "demo"
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<rev>[A-Za-z0-9_./-]+))?")
SMALL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja")
INDEX = "model.safetensors.index.json"


class CheckpointNotFound(ValueError):
    """A --checkpoint that names no local directory and could not be fetched from the Hub."""


def cache_dir() -> str:
    return os.environ.get("LING_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ling-jax"))


def demo_checkpoint(verbose: bool = True) -> str:
    """The shipped demo model's directory (or, in a stripped install, a random-weight stand-in)."""
    if os.path.isfile(os.path.join(SHIPPED, "config.json")):
        return SHIPPED
    path = os.path.join(cache_dir(), "demo-random-v1")
    if not os.path.isfile(os.path.join(path, "config.json")):
        from ling_jax.checkpoint.synthetic_config import synthetic_config
        from ling_jax.checkpoint.writer import write_checkpoint
        if verbose:
            print(f"building the demo checkpoint in {path} (once)", file=sys.stderr)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_checkpoint(synthetic_config(), path, dtype="fp8", seed=0, progress=False)
    return path


def parse_hub_id(spec: str):
    """(repo_id, revision or None) when `spec` is spelled ORG/NAME[@REVISION], else None."""
    m = HUB_ID.fullmatch(spec or "")
    if m is None or spec.startswith((".", "~")) or ".." in m.group("repo"):
        return None
    return m.group("repo"), m.group("rev")


def model_name(spec: str) -> str:
    """The name a server gives the checkpoint `spec` names: a Hub id without its revision, the
    demo model's folder name, a directory's base name."""
    if not os.path.isdir(spec):
        hub = parse_hub_id(spec)
        if hub is not None:
            return hub[0]
        if spec == DEMO:
            return os.path.basename(demo_checkpoint(verbose=False))
    return os.path.basename(os.path.normpath(spec))


def resolve_checkpoint(spec, *, weights: bool = True, what: str = "--checkpoint", verbose: bool = True) -> str:
    """The local directory `spec` names (module docstring); `weights=False` fetches no shard."""
    spec = os.fspath(spec)
    if os.path.isdir(spec):
        return spec
    if spec == DEMO:
        return demo_checkpoint(verbose)
    hub = parse_hub_id(spec)
    if hub is None:
        return spec
    return download(*hub, weights=weights, what=what)


def download(repo_id: str, revision=None, *, weights: bool = True, what: str = "--checkpoint") -> str:
    """snapshot_download of the small files, then of the shards the index names; the snapshot folder."""
    try:
        import huggingface_hub as hf
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - a dependency
        raise CheckpointNotFound(f"{what}: {repo_id} is not a local directory, and huggingface_hub (needed for "
                                 "Hub ids) is not installed") from None
    spelled = repo_id + (f"@{revision}" if revision else "")
    try:
        path = hf.snapshot_download(repo_id, revision=revision, allow_patterns=list(SMALL_FILES))
        if weights:
            shards = _shards(path)
            if shards:
                path = hf.snapshot_download(repo_id, revision=revision, allow_patterns=shards)
    except Exception as e:  # every failure is one line naming the id, the cache and the way out
        offline = constants.HF_HUB_OFFLINE
        where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
        if offline:
            raise CheckpointNotFound(f"{what}: {spelled} is not a local directory and not (completely) in {where}, "
                                     "and HF_HUB_OFFLINE=1 forbids downloading it (run once online, or unset "
                                     "HF_HUB_OFFLINE)") from None
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointNotFound(f"{what}: {spelled} is not a local directory, and fetching it from the Hub "
                                 f"({constants.ENDPOINT}) into {where} failed: {type(e).__name__}: {msg}") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointNotFound(f"{what}: the Hub repository {spelled} has no config.json (not a checkpoint)")
    return path


def _shards(path: str) -> list:
    """The shard files the index in `path` names (sorted), or model.safetensors without an index."""
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        return ["model.safetensors"]
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map") or {}
    return sorted(set(str(v) for v in weight_map.values()))
