"""One module per `ling-jax` sub-command; each defines `add_parser(subparsers)` and `run(args) -> int`.

Why the commands import the model stack inside `run` (the only function-level imports of the
package, with `commands.common.available_memory_bytes`, `checkpoint.orbax` and `checkpoint.mxfp4`'s
JAX decoder, each for the same reason): every sub-command's parser is built at start-up, and jax +
flax + orbax take ~1.5 s to import, which `ling-jax --help`, `inspect` and `plan` (header-only
commands) and every argument error would otherwise pay. The import graph, including these, is
checked for cycles by tests/test_import_graph.py.
"""

COMMANDS = ["make_checkpoint", "logits", "generate", "demo", "inspect", "plan", "convert"]
COMMANDS += ["train", "export", "eval", "quantize", "batch", "serve", "aot"]
