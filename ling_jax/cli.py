"""`ling-jax` command line: dispatches to ling_jax.commands.<name>.

Every command exits non-zero with a one-line reason on bad input (CLI contract): errors that
are the user's (bad file, bad argument: ValueError, FileNotFoundError, KeyError, OSError) print
`error: ...` and exit with status 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ling_jax.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ling-jax", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"ling_jax.commands.{name}")
        except ModuleNotFoundError as e:  # a command still being written must not break the others
            if e.name == f"ling_jax.commands.{name}":
                continue
            raise
        sp = mod.add_parser(sub)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args._run(args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
