"""Fixtures: tiny image folders, TF32 and thread settings, torch's ONNX registry built once, a tiny BERT graph.
The builders themselves live in ``helpers`` (test modules import it; nothing imports this file)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import tf32_state
from PIL import Image


def pytest_configure(config: pytest.Config) -> None:
    """Each process that runs tests gets its share of the cores: ``make test``'s two workers on two cores get one
    thread each. torch's default (every core, in each worker) put four threads on two cores, and a tiny model's many
    small ops mostly waited for the other worker (a 40-step recovery of the tiny ViT took 6-13 s at two threads and
    0.6-0.8 s at one on the loaded 2-core machine). Processes the tests start inherit the count through
    ``OMP_NUM_THREADS``; a count the caller set is kept."""
    worker = getattr(config, "workerinput", None)
    if worker is None and config.getoption("numprocesses", None):
        return  # xdist's controller: it runs no test, and its workers inherit its environment
    threads = max(1, len(os.sched_getaffinity(0)) // (worker["workercount"] if worker else 1))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    """An ImageFolder-style tree of 12 small real image files (jpg, png, webp) plus a non-image."""
    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    for i in range(12):
        cls = root / f"class{i % 2}"
        cls.mkdir(parents=True, exist_ok=True)
        arr = rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)
        Image.fromarray(arr).save(cls / f"img{i}.{('jpg', 'png', 'webp')[i % 3]}")
    (root / "notes.txt").write_text("not an image")
    return root


@pytest.fixture
def tf32_on():
    """TF32 everywhere torch allows it, as a user's script may leave it; the settings found are back after."""
    saved = tf32_state()
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield tf32_state()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


@pytest.fixture(autouse=True)
def _torch_threads():
    """A test that sets torch's thread count (``bench --threads``) leaves it as it found it: a later test that keys a
    latency table by the thread count and then runs the CLI in a fresh process would otherwise see two counts."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _torchlib_registry_once():
    """torch's ONNX exporter rebuilds its registry of torchlib functions on every export (~0.5 s, thousands of
    signatures; dozens of exports per worker): build it once per opset version and give each export its own copy of
    the table (the same entries, so the same graphs; an export that registers a custom op changes only its copy)."""
    try:
        from torch.onnx._internal.exporter._registration import ONNXRegistry

        build = ONNXRegistry.from_torchlib.__func__
    except (ImportError, AttributeError):  # no onnxscript (nothing here exports), or another torch: as torch does it
        yield
        return
    built: dict[int, ONNXRegistry] = {}

    def from_torchlib(cls, *args, **kwargs):
        if cls is not ONNXRegistry or len(args) + len(kwargs) > 1 or set(kwargs) - {"opset_version"}:
            return build(cls, *args, **kwargs)  # a subclass or an unknown call: as torch does it
        key = (args or tuple(kwargs.values()) or (None,))[0]
        if key not in built:
            built[key] = build(cls, *args, **kwargs)
        registry = cls.__new__(cls)
        registry.__dict__.update(built[key].__dict__)
        registry.functions = {target: list(metas) for target, metas in built[key].functions.items()}
        return registry

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ONNXRegistry, "from_torchlib", classmethod(from_torchlib))
        yield


@pytest.fixture(scope="session", autouse=True)
def _onnxruntime_threads():
    """onnxruntime sessions get the worker's share of the cores too (``pytest_configure``), unless the caller set a
    count: onnxruntime ignores ``OMP_NUM_THREADS`` and spins one thread per core in every session by default, in each
    worker. Sessions made by the library, onnxruntime's quantizers and the tests alike (the class's constructor)."""
    try:
        import onnxruntime
    except ImportError:  # nothing here runs a graph
        yield
        return
    init, threads = onnxruntime.InferenceSession.__init__, torch.get_num_threads()

    def shared(self, path_or_bytes, sess_options=None, *args, **kwargs):
        options = sess_options or onnxruntime.SessionOptions()
        if not options.intra_op_num_threads:
            options.intra_op_num_threads = threads
        init(self, path_or_bytes, options, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onnxruntime.InferenceSession, "__init__", shared)
        yield


@pytest.fixture(scope="session")
def bert_graph(tmp_path_factory) -> dict[str, Path]:
    """A tiny random BERT folder (``helpers.tiny_text_folder``) and its verified FP32 encoder graph as ``export``
    writes it (``export_verified``, sequence 32), exported once per session for the modules that only read them.
    Read-only: a test that writes beside the graph (quantize) copies it into its own folder first."""
    from helpers import tiny_text_folder

    from corp_deploy.exporters.pipeline import export_verified
    from corp_deploy.formats.sources import load_source

    root = tmp_path_factory.mktemp("bert-graph")
    folder = tiny_text_folder(root)
    graph = root / "graph" / "m.onnx"
    graph.parent.mkdir()
    model, description = load_source(str(folder), seq_len=32)
    export_verified(model, graph, description)
    return {"model": folder, "onnx": graph}
