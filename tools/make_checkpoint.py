#!/usr/bin/env python
"""Thin wrapper: `python tools/make_checkpoint.py ARGS` == `ling-jax make-checkpoint ARGS`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ling_jax.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["make-checkpoint", *sys.argv[1:]]))
