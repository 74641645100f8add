"""The suite itself: each process that runs tests keeps to its share of the cores (``conftest.pytest_configure``),
torch and onnxruntime alike, and passes it to the processes it starts."""

from __future__ import annotations

import os

import pytest
import torch


def test_torch_and_onnxruntime_run_on_the_workers_share_of_the_cores(tmp_path) -> None:
    """``make test``'s two workers on two cores run one thread each (four spinning threads on two cores made a tiny
    model's small ops wait for the other worker). Fails where a worker keeps torch's or onnxruntime's default."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, save

    threads = int(os.environ["OMP_NUM_THREADS"])  # set for the processes the tests start; unset before
    assert torch.get_num_threads() == threads
    x, y = (helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in "xy")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    save(helper.make_model(graph), tmp_path / "m.onnx")
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_session_options().intra_op_num_threads == threads
