"""One module per `ling-jax` sub-command; each defines `add_parser(subparsers)` and `run(args) -> int`."""

COMMANDS = ["make_checkpoint", "logits", "generate", "demo", "inspect", "plan", "convert"]
COMMANDS += ["train", "export", "eval", "quantize"]
