"""The rooms at the bottom: the optional-dependency gate, the environment collector, file hashes."""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch
from conftest import tf32_state

from corp_deploy import deps, env
from corp_deploy.errors import CorpError
from corp_deploy.fsio import sha256


def test_the_gate_names_the_distribution_and_the_install_command(monkeypatch) -> None:
    for name in ("onnxconverter_common", "onnxconverter_common.float16"):  # imports fail as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    assert deps.optional("onnxconverter_common") is None
    assert deps.missing("json", "onnxconverter_common") == "onnxconverter-common (pip install 'corp-deploy[onnx]')"
    with pytest.raises(CorpError, match=r"^FP16 ONNX needs onnxconverter-common: pip install 'corp-deploy\[onnx\]'$"):
        deps.require("onnxconverter_common.float16", "FP16 ONNX")
    assert deps.require("json", "anything") is sys.modules["json"] and deps.missing("json") is None
    assert (
        deps.install_hint("tensorrt") == "pip install 'corp-deploy[tensorrt]' --extra-index-url https://pypi.nvidia.com"
    )
    assert deps.install_hint("left_pad") == "pip install left_pad"


def test_versions_keep_the_keys_artifacts_record() -> None:
    recorded = env.versions()
    assert list(recorded) == ["corp_deploy", "torch", "timm", "python", "cuda"]
    assert recorded["torch"] == torch.__version__ and recorded["python"] == sys.version.split()[0]


def test_environment_records_cpu_versions_and_only_installed_packages(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    record = env.environment(3, {"tensorrt": "tensorrt"})
    assert record["torch_threads"] == 3 and record["cpu"] == env.cpu_name() and "tensorrt" not in record
    assert env.module_versions(["json", "tensorrt"]) == {"json": sys.modules["json"].__version__}
    assert env.device_name(torch.device("cpu")) == f"cpu ({env.cpu_name()}, {torch.get_num_threads()} threads)"


def test_sha256_of_a_file(tmp_path) -> None:
    data = b"x" * (3 << 20)  # several read chunks
    (tmp_path / "f").write_bytes(data)
    assert sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_exact_fp32_turns_tf32_off_inside_and_restores_it_even_on_an_exception(tf32_on, precision) -> None:
    torch.set_float32_matmul_precision(precision)
    before = tf32_state()
    assert before == (True, True, precision)
    with env.exact_fp32():
        assert tf32_state() == (False, False, "highest")
    assert tf32_state() == before
    with pytest.raises(KeyError), env.exact_fp32():
        assert tf32_state() == (False, False, "highest")
        raise KeyError("the verification failed")
    assert tf32_state() == before
