"""Temporaries that a crash cannot leave looking like output, and their cleanup on the next run.

Every command that writes (`make-checkpoint`, `export`, `train`'s export, `logits --out`) builds its
result under a hidden name in the target's own directory (same filesystem, so the final `rename` is
atomic) and renames it into place only when complete:

    .ling-tmp-<pid>-<random>-<final name>

After a `kill -9` the temporary stays, but it is hidden, says what it is, and carries the pid of the
process that made it. `clean_stale_temps(dir)` (called before every write into `dir`) deletes the
temporaries of processes that no longer run; a live writer's temporaries are left alone.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import Optional

TEMP_PREFIX = ".ling-tmp-"
_TEMP_RE = re.compile(r"^\.ling-tmp-(\d+)-[0-9a-f]{8}-")


def temp_path(final: str) -> str:
    """A fresh temporary path beside `final` (nothing is created)."""
    final = os.path.abspath(final)
    return os.path.join(os.path.dirname(final),
                        f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{os.path.basename(final)}")


def make_temp_dir(final: str) -> str:
    """Create and return an empty temporary directory beside `final`, with normal permissions."""
    p = temp_path(final)
    os.mkdir(p)
    return p


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


def temp_owner(name: str) -> Optional[int]:
    """The pid in a temporary's name, or None if `name` is not one of ours."""
    m = _TEMP_RE.match(name)
    return int(m.group(1)) if m else None


def clean_stale_temps(directory: str) -> list[str]:
    """Remove our temporaries in `directory` whose process is gone; returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        pid = temp_owner(name)
        if pid is None or _pid_alive(pid):
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
