"""Calibration inputs as the pass reads them (``formats.calibration``): what is said when a source holds less than
asked for."""

from __future__ import annotations

import pytest
from helpers import tiny_text_folder, tiny_vit
from PIL import Image


def test_fewer_calibration_documents_or_images_than_asked_for_are_said(tmp_path) -> None:
    """Issue 50, item 8: 2 documents used for --num-calib 8 without a word (images alike)."""
    pytest.importorskip("transformers")
    import transformers

    from corp_deploy.formats.calibration import calibration_data, text_calibration_data

    folder = tiny_text_folder(tmp_path)
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text("the news market film game")
    model = transformers.AutoModel.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with pytest.warns(UserWarning, match=r"docs holds 3 calibration documents, not the 8 asked for: calibrating on 3"):
        text_calibration_data(model, tokenizer, docs, num=8, seq_len=16)
    images = tmp_path / "images" / "a"
    images.mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (40, 40), (i * 90, 20, 30)).save(images / f"{i}.png")
    with pytest.warns(UserWarning, match=r"images holds 2 images, not the 8 asked for: calibrating on 2"):
        calibration_data(tiny_vit(), tmp_path / "images", num=8, workers=0)


def test_a_python_caller_is_warned_in_the_words_it_used() -> None:
    """Issue 50, item 12: the Python API's warnings named only CLI flags (``--calib synthetic``, ``--weights random``)
    that a Python caller never typed; they name the argument, the flag beside it."""
    from corp_deploy.families.timm.models import create_model
    from corp_deploy.formats.calibration import calibration_data

    with pytest.warns(UserWarning, match=r"^calibrating on NOISE images \(source 'synthetic'; the CLI's --calib"):
        calibration_data(tiny_vit(), "synthetic", num=4)
    with pytest.warns(UserWarning, match=r"^weights='random' \(the CLI's --weights random\)"):
        create_model("vit_tiny_patch16_224", weights="random", model_args={"img_size": 32, "depth": 1})
