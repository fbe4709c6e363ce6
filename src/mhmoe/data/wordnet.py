"""WordNet sense counts: how many senses (synsets) an English word has, over all parts of speech.

Read from the installed WordNet 3.0 database (Debian/Ubuntu package ``wordnet-base``,
:data:`mhmoe.data.corpora.WORDNET_DIR`): every line of ``index.{noun,verb,adj,adv}`` is

    lemma pos synset_cnt p_cnt [ptr_symbol ...] sense_cnt tagsense_cnt synset_offset ...

and a word's sense count is the sum of its ``synset_cnt`` over the four files. Collocations
(lemmas with ``_``) are skipped. The exception lists ``{noun,verb,adj,adv}.exc`` (``inflected base
...``, e.g. ``geese goose``) give an irregular form the senses of its base forms in that part of speech
when the form has no entry of its own there; regular inflections (``banks``, ``running``) are not
resolved (WordNet's morphological rules are not applied).
"""

from __future__ import annotations

from pathlib import Path

from mhmoe.data.corpora import WORDNET_DIR, WORDNET_POS
from mhmoe.data.documents import CorpusUnavailableError
from mhmoe.errors import DataError

MAX_WORDNET_FILE_BYTES = 64 << 20  # the largest WordNet 3.0 index file (index.noun) is ~4.8 MB
WORDNET_MISSING = "WordNet not installed ({path} missing): apt-get install wordnet-base"


def _read_lines(path: Path) -> list[str]:
    """The lines of a WordNet file, refusing files far larger than WordNet's own."""
    size = path.stat().st_size
    if size > MAX_WORDNET_FILE_BYTES:
        raise DataError(f"{path}: {size:,} bytes, more than a WordNet file ({MAX_WORDNET_FILE_BYTES:,})")
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def parse_index(lines: list[str], where: str = "index") -> dict[str, int]:
    """lemma -> synset_cnt of one ``index.POS`` file (license header lines start with two spaces)."""
    counts: dict[str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.startswith("  "):
            continue
        fields = line.split()
        try:
            n = int(fields[2])
        except (IndexError, ValueError):
            raise DataError(f"{where}:{lineno}: not a WordNet index line: {line[:80]!r}") from None
        if "_" not in fields[0]:
            counts[fields[0].lower()] = n
    return counts


def parse_exceptions(lines: list[str]) -> dict[str, list[str]]:
    """inflected form -> its base forms, from one ``POS.exc`` file."""
    out: dict[str, list[str]] = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and "_" not in fields[0]:
            out[fields[0].lower()] = [b.lower() for b in fields[1:]]
    return out


def _pos_counts(root: Path, pos: str) -> dict[str, int]:
    """Sense counts in one part of speech, the exception list's irregular forms included."""
    counts = parse_index(_read_lines(root / f"index.{pos}"), str(root / f"index.{pos}"))
    exc = root / f"{pos}.exc"
    if exc.is_file():
        for form, bases in parse_exceptions(_read_lines(exc)).items():
            if form not in counts:
                n = max((counts.get(b, 0) for b in bases), default=0)
                if n:
                    counts[form] = n
    return counts


def wordnet_sense_counts(root: Path | None = None) -> dict[str, int]:
    """Lower-cased single word -> number of WordNet senses summed over nouns, verbs, adjectives and
    adverbs (module docstring). Raises :class:`CorpusUnavailableError` naming the apt package when
    WordNet is not installed."""
    root = Path(root or WORDNET_DIR)
    for pos in WORDNET_POS:
        if not (root / f"index.{pos}").is_file():
            raise CorpusUnavailableError(WORDNET_MISSING.format(path=root / f"index.{pos}"))
    total: dict[str, int] = {}
    for pos in WORDNET_POS:
        for word, n in _pos_counts(root, pos).items():
            total[word] = total.get(word, 0) + n
    return total
