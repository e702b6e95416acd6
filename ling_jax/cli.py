"""`ling-jax` command line: dispatches to ling_jax.commands.<name>.

Every command exits non-zero with a one-line reason on bad input (CLI contract): the last line on
stderr is `error: ...` naming the file, tensor, field or argument, and there is no traceback.
Argument-syntax errors (argparse) print the usage and then that line, exit status 2; refused values
(ValueError and its subclasses: ConfigError, CheckpointError, ArgumentValueError) and file-system
errors exit 2; anything unexpected exits 1 with `error: internal error: ...` (set
LING_JAX_TRACEBACK=1 to see the traceback instead).

Every command reads and writes JAX's persistent compilation cache (`commands/compilation_cache.py`:
`--compilation-cache DIR`, `--no-compilation-cache`, env LING_JAX_COMPILATION_CACHE).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from ling_jax.commands import COMMANDS
from ling_jax.commands.compilation_cache import add_compilation_cache_flags, apply_compilation_cache_args


class Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors end with one `error: <prog>: <message>` line (usage above it)."""

    def error(self, message):
        self.print_usage(sys.stderr)
        sys.stderr.write(f"error: {self.prog}: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="ling-jax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMANDS:
        mod = importlib.import_module(f"ling_jax.commands.{name}")
        sp = mod.add_parser(sub)
        add_compilation_cache_flags(sp)  # every command: JAX's persistent compilation cache (on by default)
        sp.set_defaults(_run=mod.run)
    return p


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def resolve_checkpoint_args(args) -> None:
    """`--checkpoint` (and `inspect DIR`) may name a local directory, `demo` or a Hub id
    ORG/NAME[@REVISION] (`ling_jax/checkpoint/locate.py`): replaced by the local directory; the
    spelling stays in `args.checkpoint_spec` (a server's default model name)."""
    from ling_jax.checkpoint.locate import resolve_checkpoint
    for attr, what in (("checkpoint", "--checkpoint"), ("dir", "DIR")):
        spec = getattr(args, attr, None)
        if isinstance(spec, str):
            args.checkpoint_spec = spec
            setattr(args, attr, resolve_checkpoint(spec, what=what))


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or an argument error (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
    try:
        apply_compilation_cache_args(args)  # before the command compiles anything
        resolve_checkpoint_args(args)
        rc = args._run(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except MemoryError:
        print("error: out of host memory", file=sys.stderr)
        return 2
    except Exception as e:  # an unexpected failure: still one line unless asked for the traceback
        if os.environ.get("LING_JAX_TRACEBACK") == "1":
            raise
        print(f"error: internal error: {type(e).__name__}: {_one_line(e)} (LING_JAX_TRACEBACK=1 shows the "
              f"traceback)", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
