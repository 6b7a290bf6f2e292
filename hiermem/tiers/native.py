"""The C build of the LMDB I/O process (``lmdb_server.c``), compiled on first use.

The disk tier's background reads and write-backs run in a child process
(:mod:`.lmdb_process`).  Its Python form (``_lmdb_server.py``, py-lmdb) costs about as
much again per row as LMDB itself; the C form speaks the same protocol straight to
liblmdb.  :func:`server` builds it once per source and machine with the system's C
compiler against liblmdb (Debian/Ubuntu: ``apt-get install liblmdb-dev``; ``bash
scripts/install.sh native`` does it) and caches the executable next to the kernels'
cache; without a compiler or liblmdb it says why and the Python form runs.

``HIERMEM_LMDB_SERVER`` chooses: ``auto`` (the default: C where it builds), ``python``
(always py-lmdb), ``native`` (C, or an error naming what is missing).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("lmdb_server.c")
ENV = "HIERMEM_LMDB_SERVER"
CHOICES = ("auto", "python", "native")

_lock = threading.Lock()
_built: dict[str, tuple[Path | None, str]] = {}


class NativeServerError(RuntimeError):
    """``HIERMEM_LMDB_SERVER=native`` but the C I/O process cannot be built."""


def choice() -> str:
    """``HIERMEM_LMDB_SERVER`` (``auto`` when unset).

    Raises:
        ValueError: a value other than ``auto``, ``python`` or ``native``.
    """
    v = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if v not in CHOICES:
        raise ValueError(f"{ENV}={v!r}: expected one of {', '.join(CHOICES)}")
    return v


def _cache_dirs() -> list[Path]:
    dirs = [Path(__file__).resolve().parent / "__pycache__"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    dirs.append(Path(base) / "hiermem")
    return dirs


@functools.cache
def _tag() -> str:
    """The build's key: the source and the machine (read once a process)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(platform.machine().encode())
    return h.hexdigest()[:16]


def build() -> tuple[Path | None, str]:
    """The C I/O process's executable, built if need be: ``(path, "")``, or ``(None,
    why not)``.  Thread- and process-safe (a build lands by an atomic rename)."""
    tag = _tag()
    with _lock:
        if tag in _built:
            return _built[tag]
        for d in _cache_dirs():
            exe = d / f"lmdb_server-{tag}"
            if exe.is_file() and os.access(exe, os.X_OK):
                _built[tag] = (exe, "")
                return _built[tag]
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            why = "no C compiler (cc)"
        else:
            why = "no writable cache directory"
            for d in _cache_dirs():
                try:
                    d.mkdir(parents=True, exist_ok=True)
                    fd, tmp = tempfile.mkstemp(prefix=".lmdb_server-", dir=d)
                    os.close(fd)
                except OSError:
                    continue
                try:
                    r = subprocess.run([cc, "-O2", "-o", tmp, str(SOURCE), "-llmdb"], capture_output=True,
                                       text=True, timeout=120)
                    if r.returncode != 0:
                        last = (r.stderr.strip().splitlines() or ["?"])[-1]
                        why = f"cannot build {SOURCE.name} (is liblmdb-dev installed?): {last}"
                        break
                    os.chmod(tmp, 0o755)
                    exe = d / f"lmdb_server-{tag}"
                    os.replace(tmp, exe)
                    _built[tag] = (exe, "")
                    return _built[tag]
                except (OSError, subprocess.SubprocessError) as e:
                    why = f"cannot build {SOURCE.name}: {e}"
                    break
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
        _built[tag] = (None, why)
        return _built[tag]


def server() -> Path | None:
    """The C I/O process to run, or None for the Python one (:func:`choice`).

    Raises:
        NativeServerError: ``HIERMEM_LMDB_SERVER=native`` and it cannot be built.
    """
    c = choice()
    if c == "python":
        return None
    exe, why = build()
    if exe is None and c == "native":
        raise NativeServerError(f"{ENV}=native: {why}")
    return exe
