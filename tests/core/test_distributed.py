"""Data-parallel calibration: sharding, and real 2-process gloo runs against the single-process result.

Robust on a loaded 2-core machine: no port is ever looked up, released and then raced for. torchrun
runs with ``--standalone`` (its rendezvous binds port 0 and the workers use the agent's store); the
hand-launched ranks join a TCP store this test process hosts on a port the OS chose and holds for
the whole test, as clients (``TORCHELASTIC_USE_AGENT_STORE``, exactly what torchrun's workers do).
Process timeouts leave minutes of margin over the seconds these runs take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT, TINY_CLI_ARGS, run_here, tiny_vit
from PIL import Image
from safetensors.torch import load_file, save_file

from corp_deploy.core.distributed import World, _until_released, shard

PROCESS_TIMEOUT = 420
"""Seconds any launched process may take: these runs need ~15 s, but two cold torch imports on two busy cores can
take a minute or more."""


def test_shards_are_disjoint_complete_and_ordered() -> None:
    items = list(range(23))
    parts = [shard(items, World(rank, 4)) for rank in range(4)]
    assert sorted(sum(parts, [])) == items
    assert all(len(p) in (5, 6) for p in parts) and parts[1] == [1, 5, 9, 13, 17, 21]
    assert shard(items, World()) == items
    assert shard(items[:2], World(3, 4)) == []  # more ranks than images: an empty shard, not an error


def test_a_rank_waits_until_no_other_thread_holds_a_reduced_chunk() -> None:
    """A tensor kept alive only by C++ (here autograd, in a run gloo's worker) keeps its weak reference alive:
    the wait before a rank exits holds until that holder lets go, so no worker needs the GIL at shutdown."""
    held = torch.full((3,), 2.0)
    graph = torch.ones(3, requires_grad=True) * held  # saves ``held`` for the backward
    sent = [weakref.ref(held)]
    del held
    with pytest.raises(TimeoutError, match="not released"):
        _until_released(sent, 0.05)
    del graph
    _until_released(sent, 0.05)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A checkpoint (so every process builds the same model) and 21 calibration images."""
    tmp = tmp_path_factory.mktemp("dist")
    checkpoint = tmp / "dense.safetensors"
    save_file(tiny_vit().state_dict(), str(checkpoint))
    rng = np.random.default_rng(0)
    images = tmp / "images"
    images.mkdir()
    for i in range(21):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(images / f"{i:02d}.png")
    return checkpoint, images


def _prune_argv(checkpoint: Path, images: Path, out: Path, *extra: str) -> list[str]:
    return [
        "prune",
        "deit_tiny",
        "--checkpoint",
        str(checkpoint),
        *TINY_CLI_ARGS,
        "--round-to",
        "4",
        "--calib-dir",
        str(images),
        "--calib-batch-size",
        "4",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--quiet",
        "--out",
        str(out),
        *extra,
    ]


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        argv,
        cwd=ROOT,
        env={**clean, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
    )


@pytest.fixture
def store_port():
    """Port of a TCP store hosted here for the whole test; the ranks connect to it instead of hosting one."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


@pytest.mark.e2e
def test_two_gloo_processes_give_the_single_process_model(inputs, tmp_path, capsys) -> None:
    checkpoint, images = inputs
    run_here(_prune_argv(checkpoint, images, tmp_path / "one"), None, capsys)  # the reference needs no new process
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    two = _run([*torchrun, "-m", "corp_deploy", *_prune_argv(checkpoint, images, tmp_path / "two")])
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("wrote ") == 1  # rank 0 alone reports and writes

    a, b = (
        load_file(str(tmp_path / "one" / "model.safetensors")),
        load_file(str(tmp_path / "two" / "model.safetensors")),
    )
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)
    meta = json.loads((tmp_path / "two" / "corp.json").read_text())["report"]["calibration"]
    assert meta["images"] == 21 and meta["processes"] == 2


def _rank_env(rank: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store at MASTER_ADDR:PORT is hosted by the test
    }


@pytest.mark.e2e
def test_a_rank_that_never_joins_fails_the_job_after_the_timeout(inputs, tmp_path, store_port) -> None:
    checkpoint, images = inputs
    argv = [
        sys.executable,
        "-m",
        "corp_deploy",
        *_prune_argv(checkpoint, images, tmp_path / "out", "--dist-timeout", "3"),
    ]
    alone = _run(argv, _rank_env(0, store_port))
    assert alone.returncode == 1
    (line,) = alone.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: rank 0: could not join the gloo process group") and "Traceback" not in alone.stderr
    assert "timeout" in line.lower() or "timed out" in line.lower(), line  # waited for rank 1, nothing else failed
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_a_rank_that_dies_mid_job_fails_it_with_no_artifact(inputs, tmp_path, store_port) -> None:
    checkpoint, images = inputs
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "corp_deploy"]
    # The timeout bounds how long rank 0 waits for rank 1 to join and to answer; rank 1's death is usually
    # seen at once (its connection closes), the timeout only if it is not.
    timeout = ["--dist-timeout", "120"]
    rank0 = subprocess.Popen(
        [*cmd, *_prune_argv(checkpoint, images, out, *timeout)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **_rank_env(0, store_port)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        empty = tmp_path / "empty"
        empty.mkdir()
        rank1 = _run([*cmd, *_prune_argv(checkpoint, empty, out, *timeout)], _rank_env(1, store_port))
        assert rank1.returncode == 1 and "no images" in rank1.stderr  # dies after joining, before the all-reduce
        _, err = rank0.communicate(timeout=PROCESS_TIMEOUT)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.communicate()
    assert rank0.returncode == 1, err
    assert "merging calibration statistics failed" in err and "Traceback" not in err
    assert not out.exists()
