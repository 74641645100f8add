"""The steps after a finished result (a prune's exports, a sweep's points): each says when it starts and how long it
took, and one that stops keeps what finished.

A step that fails or is interrupted becomes one ``Stopped`` line: what stopped and why, what the output folder
holds now (only whole files: every writer is staged, ``fsio.staged``, so an unfinished one left nothing), and the
command that finishes the job. A finished prune is minutes of work; the export that follows it must not take it
down with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from corp_deploy.base.errors import CorpError, first_line

T = TypeVar("T")

INTERRUPTED = 130
"""The exit status of a run stopped by Ctrl-C (128 + SIGINT), as shells report it."""


class Stopped(CorpError):
    """A step stopped after earlier results were written: the CLI prints it as its one line and exits with
    ``exit_code``; ``bug`` is the unexpected exception behind it, if any (its traceback is printed first)."""

    def __init__(self, message: str, interrupted: bool, bug: BaseException | None = None, what: str = "") -> None:
        super().__init__(message)
        self.exit_code = INTERRUPTED if interrupted else 1
        self.bug = bug
        self.what = what or message
        """What stopped and why, without what the folder holds: for a caller whose folder is not kept."""


def written(folder: Path) -> list[str]:
    """What ``folder`` holds, by name, folders with a slash (staging folders, dot-named, are not results), a
    ``<file>.json`` sidecar left out beside its file: what a closing summary lists, read from the disk."""
    names = {
        p.name: f"{p.name}/" if p.is_dir() else p.name for p in Path(folder).iterdir() if not p.name.startswith(".")
    }
    return sorted(shown for name, shown in names.items() if not (name.endswith(".json") and name[:-5] in names))


def holds(folder: Path) -> str:
    """What ``folder`` holds, by name (sidecars left out, ``written``): for a ``Stopped`` line."""
    names = written(folder)
    return f"{folder}/ holds {', '.join(names)}" if names else f"{folder}/ is empty"


class Steps:
    """The named steps of one run writing into ``folder``: ``with steps("ONNX export"): ...``.

    ``finish`` gives, when a step stops, the command(s) that make what is still missing (it looks at the folder
    then). ``seconds`` records each finished step's time for the run's summary.
    """

    def __init__(self, folder: Path, finish: Callable[[], str], say: Callable[[str], None] = print) -> None:
        self.folder, self.finish, self.say = Path(folder), finish, say
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            self.say(f"{what}...")  # inside: an interrupt as soon as it is said is the step's
            yield
        except Stopped:
            raise
        except KeyboardInterrupt:
            raise self.stopped(f"interrupted during {what}", True) from None
        except Exception as e:
            cause = first_line(e) if isinstance(e, CorpError) else f"{type(e).__name__}: {first_line(e)}"
            bug = None if isinstance(e, CorpError) else e
            raise self.stopped(f"{what} failed: {cause}", False, bug) from None
        self.seconds[what] = time.perf_counter() - start
        self.say(f"{what}: done in {self.seconds[what]:.1f} s")

    def wall_time(self, total: float, before: dict[str, float]) -> str:
        """One line whose parts add up to ``total`` (seconds since the command started): ``before`` (what ran before
        the steps, e.g. ``{"prune": 12.0}``: loading, data, any latency table and the prune), each step, the rest."""
        parts = {**before, **self.seconds}
        parts["the rest"] = max(0.0, total - sum(parts.values()))
        return f"wall time {total:.1f} s = " + " + ".join(f"{what} {s:.1f} s" for what, s in parts.items())

    def stopped(self, what: str, interrupted: bool, bug: BaseException | None = None) -> Stopped:
        """``what`` stopped: the line that says so, what the folder holds (all whole), and how to finish."""
        return Stopped(f"{what}; {holds(self.folder)} (all whole); to finish: {self.finish()}", interrupted, bug, what)


def _given(flag: str, value: Any) -> str:
    """One option as a command line would say it: ``--seq-len 32``, ``--frontier``, ``no --max-drop``."""
    if value is None or value is False:
        return f"no {flag}"
    return flag if value is True else f"{flag} {value}"


def check_resume(folder: Path, made_with: dict[str, Any] | None, options: dict[str, Any]) -> None:
    """``--resume`` continues ``folder`` only with the options its finished parts were made with (``made_with``, the
    fingerprint its record holds): results of two settings would mix silently. One line names the first option
    that differs."""
    if made_with is None:
        raise CorpError(
            f"--resume: {folder} records no options (made by an older version), so mixing settings cannot be ruled "
            "out; start again with --overwrite"
        )
    for flag in sorted(made_with.keys() | options.keys()):
        if made_with.get(flag) != options.get(flag):
            raise CorpError(
                f"--resume: {folder} was made with {_given(flag, made_with.get(flag))}, this command has "
                f"{_given(flag, options.get(flag))}; resume with the options it was made with, or start again with "
                "--overwrite"
            )


def each(what: str, items: Iterable[tuple[str, T]], say: Callable[[str], None] = print) -> Iterator[T]:
    """``items`` ((label, item) pairs) one at a time, each announced before it runs: its place, how long the step has
    run, and about how long the rest will take (the mean of the items done so far): a step over many slow items
    (graphs exported and verified, recipes tried, folders built) is never minutes of one silent line."""
    items = list(items)
    start = time.perf_counter()
    for done, (label, item) in enumerate(items):
        elapsed = time.perf_counter() - start
        eta = f", about {elapsed / done * (len(items) - done):.0f} s left" if done else ""
        say(f"  {what} {done + 1}/{len(items)}: {label} ({elapsed:.0f} s so far{eta})")
        yield item


def phases(name: str, say: Callable[[str], None]) -> Callable[[str | None], None]:
    """``phase(what)``: says, in one line, how long the last phase of ``name`` took and that ``what`` starts (None:
    the last one ended): the phases of one slow item (a genai folder, an INT4 graph at the 1.7B shape, each minutes)
    are never one silent line."""
    state: dict[str, Any] = {"what": None, "start": time.perf_counter()}

    def phase(what: str | None) -> None:
        now = time.perf_counter()
        done = f"{state['what']} took {now - state['start']:.0f} s" if state["what"] else ""
        say(f"    {name}: " + "; ".join(x for x in (done, what and f"{what}...") if x))
        state.update(what=what, start=now)

    return phase
