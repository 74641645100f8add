"""One vocabulary across commands (issue 50, item 13): a test that walks every command's options, so a flag spelled
two ways fails here, not in a user's script."""

from __future__ import annotations

import re
from collections import defaultdict

import click
import pytest
from helpers import run

from corp_deploy.cli import cli
from corp_deploy.cli.options import RENAMED

FORMAT_FILES = {"--json", "--csv", "--markdown", "--plot"}
"""``bench``'s extra files, each a format of the one record; every other output is ``--out``."""
PRECISION_WORDS = ("fp32", "fp16", "bf16", "int8", "int4")


def options() -> list[tuple[str, click.Option]]:
    """(command, option) for every option of every command (``--help`` and ``--version`` are click's)."""
    return [
        (name, p)
        for name, command in sorted(cli.commands.items())
        for p in command.params
        if isinstance(p, click.Option) and p.name not in ("help", "version")
    ]


def test_one_setting_has_one_spelling_in_every_command() -> None:
    """The same setting (its parameter name) is spelled with the same flags wherever it appears."""
    spellings = defaultdict(set)
    for command, p in options():
        spellings[p.name].add((tuple(sorted(p.opts)), command))
    for name, found in spellings.items():
        assert len({opts for opts, _ in found}) == 1, f"{name} is spelled two ways: {sorted(found)}"


OWN_DEFAULTS = {
    "num_calib": "demo: sized for a 2-core CPU; prune's default depends on the model's modality",
    "seq_len": "bench and eval read it from the run where it is left out",
    "workers": "prune's default is the CPU count; eval and quantize decode in the main process",
    "out": "each command's own folder or file",
    "precision": "what each command writes: the graphs (export), the engine (build-engine), both (prune-export)",
    "batch_sizes": "bench's default depends on the run (a decoder's 1,8)",
}
"""Settings whose defaults differ between commands, and why."""


def test_one_setting_has_one_default_in_every_command() -> None:
    """demo --target defaulted to ``both``, prune's to ``mlp,qk`` (issue 50, item 13): a setting shared by commands
    starts from the same value in each, unless ``OWN_DEFAULTS`` says why not."""
    defaults = defaultdict(set)
    for command, p in options():
        defaults[p.name].add((repr(p.default), command))
    for name, found in defaults.items():
        if name not in OWN_DEFAULTS:
            assert len({d for d, _ in found}) == 1, f"{name} has two defaults: {sorted(found)}"


def test_every_flag_a_help_names_is_the_commands_own_or_says_whose() -> None:
    """``sweep --help`` said "instead of --sparsity" (sweep has --sparsities), ``export --rewrites`` named --latency-on
    (which export lacks) (issue 50, item 13): a flag a help names is one of its command's, or follows the command
    that has it (``prune --latency-table``)."""
    for name, command in sorted(cli.commands.items()):
        own = {flag for p in command.params for flag in getattr(p, "opts", ())} | {"--help"}
        for p in command.params:
            text = getattr(p, "help", None) or ""
            for m in re.finditer(r"--[a-z0-9][a-z0-9-]*", text):
                whose = re.search(r"([a-z-]+) \S*$", text[: m.start()])
                named = whose is not None and whose.group(1) in cli.commands
                assert m.group() in own or named, f"{name} {p.opts[0]}'s help names {m.group()}, not {name}'s"


def test_every_output_path_is_out() -> None:
    """Where a command writes a file or folder it names it with --out (bench's format files aside)."""
    for command, p in options():
        for flag in p.opts:
            writes = flag in ("--output", "--out-dir", "--output-dir", "--dest") or flag.startswith("--out-")
            assert not writes, f"{command} {flag}: outputs are --out"
            assert flag not in FORMAT_FILES or command == "bench", f"{command} {flag}: outputs are --out"


BATCH_FLAG = re.compile(r"--([a-z0-9]+-)*batch-(size|sizes|range)")
"""The one pattern of a batch flag: ``[X-]batch-size`` (one size), ``[X-]batch-sizes`` (a comma list) or
``batch-range`` (an engine profile MIN:OPT:MAX, as ``--seq-range``)."""


def test_every_batch_flag_follows_one_pattern() -> None:
    """``--latency-batch``, ``--int8-batch`` (one size), ``--verify-batches`` (a list) and ``--batch`` (a range) beside
    ``--calib-batch-size`` and ``--batch-sizes`` (issue 50, item 13): a flag that names a batch is one size, a list
    or a range, each spelled one way (never ``--bs`` or ``--batchsize``)."""
    flags = [(c, flag) for c, p in options() for flag in p.opts if "batch" in flag or "bs" in flag.split("-")]
    assert flags, "no batch flag found: the walk is broken"
    for command, flag in flags:
        assert BATCH_FLAG.fullmatch(flag), f"{command} {flag}: a batch flag is [X-]batch-size, -sizes or batch-range"


def test_every_option_is_shown_in_its_help() -> None:
    """No hidden option: an old spelling is not a second, silent way in (``RENAMED`` answers it instead)."""
    for command, p in options():
        assert not p.hidden, f"{command} {p.opts[0]} is hidden: name it in RENAMED instead"


def test_every_command_that_writes_graphs_chooses_them_with_one_precision_flag() -> None:
    """A precision is chosen with --precision everywhere: no flag named after one precision (export's --fp16 and
    prune-export's --int8 beside --precision, issue 50 item 13)."""
    for command, p in options():
        for flag in p.opts:
            assert flag.removeprefix("--") not in PRECISION_WORDS, f"{command} {flag}: use --precision"


def test_no_command_has_an_old_spelling_and_every_new_one_exists() -> None:
    """``RENAMED`` is the whole list of old flags: none is declared anywhere, and each points at a declared flag."""
    declared = {flag for _, p in options() for flag in p.opts}
    for old, new in RENAMED.items():
        assert old not in declared, f"{old} is declared again"
        assert new.split()[0] in declared, f"{old} points at {new}, which no command has"


@pytest.mark.parametrize(
    "argv",
    [
        ["prune-export", "deit_tiny", "--int8"],
        ["export", "deit_tiny", "--fp16", "--out", "x.onnx"],
        ["build-engine", "x.onnx", "--batch=1:4:8"],
        ["export", "deit_tiny", "--verify-batches", "1,2", "--out", "x.onnx"],
        ["prune", "deit_tiny", "--latency-batch", "2"],
        ["quantize", "run", "--int8-batch", "4"],
    ],
    ids=["int8", "fp16", "batch", "verify-batches", "latency-batch", "int8-batch"],
)
def test_an_old_spelling_is_one_line_naming_the_new_one(argv, tmp_path, monkeypatch, capsys) -> None:
    """A script written for an old flag stops before any work, told the new spelling in one line (click alone said
    "No such option: --int8", or guessed --int8-calib)."""
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run(argv, capsys)
    old = next(a.split("=")[0] for a in argv if a.split("=")[0] in RENAMED)
    assert code == 2 and stderr.splitlines() == [f"error: {old} is now {RENAMED[old]} (one vocabulary across commands)"]
    assert not list(tmp_path.iterdir()), "wrote something"


def test_quantize_says_it_picks_among_static_and_dynamic_recipes() -> None:
    """quantize was described as static Q/DQ while it keeps the fastest passing recipe, often a dynamic one."""
    quantize = cli.commands["quantize"]
    precision = next(p for p in quantize.params if p.name == "precision")
    for text in (quantize.help, precision.help):
        assert "dynamic" in text and "static Q/DQ" in text, text
