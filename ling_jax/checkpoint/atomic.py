"""Temporaries that a crash cannot leave looking like output, and their cleanup on the next run.

Every command that writes (`make-checkpoint`, `export`, `quantize`, `train`'s export, `logits --out`)
builds its result under a hidden name in the target's own directory (same filesystem, so the final
`rename` is atomic) and renames it into place only when complete (`staged_dir`):

    .ling-tmp-<pid>-<random>-<final name>

After a `kill -9` the temporary stays, but it is hidden, says what it is, and carries the pid of the
process that made it. `clean_stale_temps(dir)` (called before every write into `dir`) deletes the
temporaries of processes that no longer run; a live writer's temporaries are left alone.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from typing import Iterator

TEMP_PREFIX = ".ling-tmp-"
_TEMP_RE = re.compile(r"^\.ling-tmp-(\d+)-[0-9a-f]{8}-")


def temp_path(final: str) -> str:
    """A fresh temporary path beside `final` (nothing is created)."""
    final = os.path.abspath(final)
    return os.path.join(os.path.dirname(final),
                        f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{os.path.basename(final)}")


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
    """A fresh, empty temporary directory beside `out_dir` (normal permissions), renamed onto `out_dir`
    when the block completes and deleted on any error, so a failure never leaves a half-written
    result. An existing `out_dir` is replaced only then (renames within one parent directory; a
    reader never sees a partial one): it is parked under a temporary name first, then deleted."""
    tmp = temp_path(out_dir)
    os.mkdir(tmp)
    try:
        yield tmp
        if os.path.exists(out_dir):
            old = temp_path(out_dir)
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def prepare_out_dir(out_dir: str, overwrite: bool, flag: str = "overwrite") -> str:
    """Absolute `out_dir`: refuses a file or a non-empty directory unless `overwrite`; removes stale
    temporaries of earlier, killed runs from its parent (`clean_stale_temps`)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ValueError(f"{out_dir}: exists and is not a directory")
        if os.listdir(out_dir) and not overwrite:
            raise ValueError(f"{out_dir}: directory exists and is not empty (use {flag})")
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    clean_stale_temps(os.path.dirname(out_dir))
    return out_dir


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale_temps(directory: str) -> list[str]:
    """Remove our temporaries in `directory` whose process is gone; returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TEMP_RE.match(name)  # one of ours: named with the pid of the process that made it
        if m is None or _pid_alive(int(m.group(1))):
            continue
        p = os.path.join(directory, name)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            removed.append(name)
        except OSError:
            pass
    return removed
