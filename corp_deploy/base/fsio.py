"""Files that appear whole or not at all, and the cache folder: the write side of every artifact.

Everything corp-deploy writes goes through ``staged`` (or ``atomic_file``/``atomic_dir`` on top of it),
so an interrupted run never leaves a half-written model, graph or engine under its final name.
Imports nothing heavy: exporters and benchmarks use it without loading the pruning stack.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from corp_deploy.base.errors import CorpError, first_line

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
"""A full disk and a full quota: the same to the user, who frees space or writes elsewhere."""
FREE_SPACE = "free space on that disk or choose another output path"
FULL_BELOW = 1 << 20
"""Free bytes under which a stage's disk counts as full: some writers fail there without saying why (onnx's
C++ shape inference truncates its output silently, and the next reader reports a corrupt protobuf)."""


def cache_dir() -> Path:
    """Where corp-deploy keeps what is costly to remake and safe to share: ``$XDG_CACHE_HOME/corp-deploy``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "corp-deploy"


def sha256(*paths: str | Path) -> str:
    """Hex sha256 of files read one after another in 1 MiB chunks: what sidecars record to tie an output to
    its input (several files when the input is several, as an ONNX graph and its external weights are)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def no_space(e: BaseException) -> bool:
    """Whether ``e`` says a write ran out of disk space (or quota).

    An ``OSError`` says so by its errno. Libraries that wrap the OS error in their own type say so
    only in its text (safetensors: "I/O error: No space left on device (os error 28)"), so that is
    read too.
    """
    if isinstance(e, OSError):
        return e.errno in NO_SPACE
    return any(os.strerror(code) in str(e) for code in NO_SPACE)


class NoSpace(CorpError):
    """A full disk: the destination, the writer's own words (``cause``) and what to do, in one line."""

    def __init__(self, out: str | Path, cause: str) -> None:
        super().__init__(
            f"could not write {out}: out of disk space ({cause}); {FREE_SPACE} (whatever was there is unchanged)"
        )
        self.cause = cause


def check_writable(out: str | Path, overwrite: bool) -> None:
    """Fail before any work when ``out`` exists and may not be replaced, or cannot be created at all.

    Creating is tried, not guessed from permission bits (root passes every ``os.access`` check, yet
    cannot write under /proc): a scratch folder made and removed in the nearest existing ancestor.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise CorpError(f"output {out} already exists; choose another --out or pass --overwrite")
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        with held_interrupt():  # made and removed: never left behind by a Ctrl-C between the two
            os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.check-", dir=ancestor))
    except OSError as e:
        raise CorpError(f"cannot write {out}: {e.strerror} ({ancestor})") from None


@contextmanager
def held_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block is done, then deliver it: a folder made and then removed, or made
    and handed to the ``try`` that removes it, is never left behind by an interrupt landing between the two.
    Only the main thread handles signals; elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)


@contextmanager
def staged(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; what is written there moves next to ``out`` on success.

    For a file with companions (``x.onnx`` + ``x.onnx.data`` + ``x.onnx.json``, an engine and its
    sidecar): write them under their final names; the companions move first and ``out`` last, so
    ``out`` never appears without them. On failure nothing moves, the folder is removed, and an
    existing ``out`` is left untouched. A full disk, whichever library was writing and however it
    failed, ends as one line naming ``out``: this is the one place that knows the destination of
    every writer.
    """
    out = Path(out)
    check_writable(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = None
    try:
        with held_interrupt():  # an interrupt once the folder exists lands inside the try, which removes it
            stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        yield stage
        if not (stage / out.name).exists():
            raise RuntimeError(f"staged output {out.name} was not written")
        _chmod_default(stage)
        for f in sorted(stage.iterdir(), key=lambda f: f.name == out.name):
            _replace(f, out.parent / f.name)
    except Exception as e:
        if isinstance(e, NoSpace):  # from a stage inside this one: name the outer destination, the one asked for
            raise NoSpace(out, e.cause) from None
        if no_space(e) or _full(out.parent):
            raise NoSpace(out, first_line(e)) from None
        raise
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)


def _full(folder: Path) -> bool:
    with suppress(OSError):
        return shutil.disk_usage(folder).free < FULL_BELOW
    return False


def _replace(src: Path, dst: Path) -> None:
    """``os.replace`` that also replaces an existing folder (moved aside first, then deleted)."""
    if not (dst.is_dir() and not dst.is_symlink()):
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(old / dst.name, dst)  # the new one could not move in: the old one goes back
        old.rmdir()
        raise
    shutil.rmtree(old)


@contextmanager
def atomic_file(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path that becomes ``out`` only if the block completes."""
    with staged(out, overwrite) as stage:
        yield stage / Path(out).name


@contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` only if the block completes."""
    with atomic_file(out, overwrite) as tmp:
        tmp.mkdir()
        yield tmp


def _chmod_default(folder: Path) -> None:
    """mkdtemp makes private folders; give the finished artifact the permissions the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.rglob("*"):
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)
