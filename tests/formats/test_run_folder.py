"""The run folder's format (``formats.run_folder``): the names ``prune-export`` writes are the names ``bench`` reads,
and folders written by earlier versions keep these names, so they are pinned here."""

from __future__ import annotations

import json

import pytest

from corp_deploy.base.errors import CorpError
from corp_deploy.formats import run_folder
from corp_deploy.formats.artifact import META_FILE


def test_the_names_of_a_run_folder_are_those_earlier_versions_wrote() -> None:
    assert run_folder.MODELS == ("dense", "pruned") and run_folder.ARTIFACT == "pruned"
    assert [run_folder.onnx_name("dense"), run_folder.onnx_name("pruned", "int8")] == ["dense.onnx", "pruned.int8.onnx"]
    assert run_folder.engine_name("pruned", "fp16") == "pruned.fp16.plan"
    assert [run_folder.genai_name("dense"), run_folder.genai_name("pruned", int4=True)] == [
        "dense-genai",
        "pruned-genai-int4",
    ]
    assert run_folder.RECORD == "export.json" and run_folder.sidecar("x/pruned.onnx").name == "pruned.onnx.json"


def test_a_sidecar_reads_back_what_was_written_and_a_missing_or_broken_one_reads_empty(tmp_path) -> None:
    graph = tmp_path / "pruned.onnx"
    run_folder.write_sidecar(graph, {"modality": "text", "seq_len": 16})
    assert run_folder.read_sidecar(graph) == {"modality": "text", "seq_len": 16}
    assert run_folder.read_sidecar(tmp_path / "dense.onnx") == {}
    (tmp_path / "dense.onnx.json").write_text("{not json")
    assert run_folder.read_sidecar(tmp_path / "dense.onnx") == {}


def test_check_takes_a_run_folder_and_says_what_anything_else_is(tmp_path) -> None:
    (tmp_path / "run" / "pruned").mkdir(parents=True)
    with pytest.raises(CorpError, match="not a prune-export folder"):
        run_folder.check(tmp_path / "run")
    (tmp_path / "run" / "pruned" / META_FILE).write_text(json.dumps({}))
    assert run_folder.check(str(tmp_path / "run")) == tmp_path / "run"
    with pytest.raises(CorpError, match="is a prune artifact; bench a `corp-deploy prune-export` folder"):
        run_folder.check(tmp_path / "run" / "pruned")
