"""``studies.text_int8_study`` pools as the sentence-transformers folder declares, so its pooled figures are what
that folder's users read: checked against sentence-transformers' own Pooling and Normalize modules."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from corp_deploy.base.errors import CorpError
from studies.text_int8_study import declared_pooling, figures, pool


def _folder(root: Path, modules: list[str], **modes: bool) -> Path:
    root.mkdir()
    entries = [
        {"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
        for i, (t, p) in enumerate(
            (t, {"Pooling": "1_Pooling", "Normalize": "2_Normalize"}.get(t, "")) for t in modules
        )
    ]
    (root / "modules.json").write_text(json.dumps(entries))
    if "Pooling" in modules:
        (root / "1_Pooling").mkdir()
        config = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False}
        (root / "1_Pooling" / "config.json").write_text(json.dumps(config | modes))
    return root


@pytest.mark.parametrize("mode", ["mean", "cls", "max"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_matches_sentence_transformers(tmp_path, mode: str, normalize: bool) -> None:
    st = pytest.importorskip("sentence_transformers.sentence_transformer.modules", reason="sentence-transformers 6")
    torch = pytest.importorskip("torch")
    key = "pooling_mode_cls_token" if mode == "cls" else f"pooling_mode_{mode}_tokens"
    modules = ["Transformer", "Pooling", *(["Normalize"] if normalize else [])]
    pooling = declared_pooling(_folder(tmp_path / "m", modules, **{key: True}))
    assert pooling == {"mode": mode, "normalize": normalize}

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((3, 5, 8)).astype(np.float32)
    mask = np.array([[1] * 5, [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    hidden[mask == 0] = 1e3  # padding: read by nobody
    features = {"token_embeddings": torch.from_numpy(hidden), "attention_mask": torch.from_numpy(mask)}
    expected = st.Pooling(8, pooling_mode=mode)(features)
    if normalize:
        expected = st.Normalize()(expected)
    np.testing.assert_allclose(pool(hidden, mask, pooling), expected["sentence_embedding"].numpy(), rtol=1e-5)


def test_a_folder_without_pooling_is_refused(tmp_path) -> None:
    with pytest.raises(CorpError, match="declares no Pooling module"):
        declared_pooling(_folder(tmp_path / "m", ["Transformer"]))


def test_figures_are_per_row() -> None:
    ref = np.array([[1.0, 0.0], [0.0, 1.0]])
    got = np.array([[1.0, 0.0], [1.0, 1.0]])
    out = figures(ref, got)
    assert out["rows"] == 2 and out["worst_cosine"] == pytest.approx(2**-0.5) and out["rel_error"] == 1.0
