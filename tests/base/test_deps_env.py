"""The light modules at the bottom: the optional-dependency gate, the environment collector, file hashes."""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch
from helpers import ROOT, run, tf32_state, tiny_text_folder

from corp_deploy.base import deps, env
from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import sha256


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


def fake_versions(monkeypatch, **versions: str) -> None:
    """The installed distributions' metadata says ``versions`` (distribution -> version) for these, the truth for
    the rest: an old release as pip would leave it, without installing one."""
    real = deps.metadata.version
    monkeypatch.setattr(deps.metadata, "version", lambda name: versions.get(name) or real(name))


@pytest.mark.parametrize(
    ("module", "dist"),
    [
        ("transformers", "transformers"),
        ("onnxruntime_genai", "onnxruntime-genai"),
        ("sentence_transformers", "sentence-transformers"),
        ("onnx", "onnx"),
        ("onnxruntime", "onnxruntime"),
    ],
)
def test_an_installed_release_below_the_floor_is_one_line_naming_the_version_needed(monkeypatch, module, dist) -> None:
    """The metadata is read before the import: an old release never gets to fail inside a forward."""
    monkeypatch.setitem(sys.modules, module, None)  # an import would fail the test's other way: "not installed"
    fake_versions(monkeypatch, **{dist: "0.1.0"})
    needed = f"{dist}>={deps.FLOORS[dist]}"
    line = rf"^the test: {dist} 0.1.0 is installed, older than the {needed} corp-deploy needs"
    with pytest.raises(CorpError, match=line) as e:
        deps.require(module, "the test")
    assert "\n" not in str(e.value) and str(e.value).endswith(f"pip install -U '{needed}'")
    assert deps.optional(module) is None and needed in deps.missing("json", module)


def test_a_release_at_or_above_the_floor_passes_and_releases_compare_numerically(monkeypatch) -> None:
    fake_versions(monkeypatch, transformers="5.23.0", onnx="1.100.0rc1")
    assert deps.too_old("transformers") is None and deps.too_old("onnx") is None
    fake_versions(monkeypatch, transformers="4.57.1", onnx="1.9")
    assert "transformers>=5.23" in deps.too_old("transformers") and "onnx>=1.16" in deps.too_old("onnx")
    assert deps.release("5.24.0") == (5, 24) and deps.release("1.23.0rc1") == (1, 23) and deps.release("x") == (0,)
    assert deps.too_old("json") is None  # no floor


def test_the_floors_are_pyproject_ranges() -> None:
    """Every ``>=`` of pyproject.toml on a gated distribution is its floor here: the two cannot drift apart."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ranges = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    listed = {}
    for requirement in ranges:
        name, _, rest = requirement.partition(">=")
        if rest:
            listed[name.strip()] = rest.split(",")[0].strip()
    gated = {dist for dist, _ in deps.PACKAGES.values()}
    assert {d: v for d, v in listed.items() if d in gated} == {d: v for d, v in deps.FLOORS.items() if d in listed}
    assert {"transformers", "onnx", "onnxruntime"} <= set(listed) and set(deps.FLOORS) <= gated


@pytest.mark.e2e
def test_prune_with_an_old_transformers_stops_in_one_line_before_any_work(tmp_path, capsys, monkeypatch) -> None:
    folder = tiny_text_folder(tmp_path)
    fake_versions(monkeypatch, transformers="4.57.0")
    capsys.readouterr()  # the folder's writing
    out = tmp_path / "out"
    code, _, err = run(["prune", str(folder), "--calib", "synthetic", "--quiet", "--out", str(out)], capsys)
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "transformers 4.57.0 is installed, older than the transformers>=5.23" in err and not out.exists()


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
