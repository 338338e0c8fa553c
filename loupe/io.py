"""Small file helpers shared by every stage: atomic writes, so a killed job never leaves half a file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp/mkdtemp create private files (0600) and folders (0700); outputs are shared data (a container running
# as another user reads them), so they get the modes an ordinary open() or mkdir() would have given.
FILE_MODE = 0o666 & ~_umask()
DIR_MODE = 0o777 & ~_umask()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n")


def make_readable(folder: Path) -> None:
    """Ordinary modes for everything under `folder`: transformers and tempfile write private (0600/0700)
    files and folders, and a container's user or a shared DVC cache must be able to read a saved model."""
    for path in Path(folder).rglob("*"):
        os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Build a folder under a temporary name beside `final`, then swap it into place in one rename.

    A run killed inside the block leaves `final` as it was (or absent) and only a `.final.partial-*` folder,
    which the next run removes.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.partial-"))
    os.chmod(tmp, DIR_MODE)
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_digest(path: Path, algorithm: str = "sha256") -> str:
    """A file's hex digest with hashlib's `algorithm`, read in 1 MiB blocks."""
    digest = hashlib.new(algorithm)
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
