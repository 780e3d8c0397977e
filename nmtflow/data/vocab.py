"""Special token ids and pieces shared by every vocabulary in nmtflow.

Every SentencePiece model trained by :class:`nmtflow.data.tokenizer.Tokenizer`
reserves the first four ids for these symbols, so models, batching and decoding
can rely on the constants below without looking at a tokenizer.
"""

from __future__ import annotations

PAD, UNK, BOS, EOS = 0, 1, 2, 3

PAD_PIECE = "<pad>"
UNK_PIECE = "<unk>"
BOS_PIECE = "<s>"
EOS_PIECE = "</s>"

#: Pieces of the special ids, indexed by id.
SPECIAL_PIECES: tuple[str, str, str, str] = (PAD_PIECE, UNK_PIECE, BOS_PIECE, EOS_PIECE)
NUM_SPECIAL = len(SPECIAL_PIECES)


def lang_tag(lang: str) -> str:
    """Return the target-language tag piece for ``lang``, e.g. ``"de" -> "<2de>"``."""
    if not lang or any(c.isspace() for c in lang) or any(c in "<>" for c in lang):
        raise ValueError(f"invalid language code {lang!r}: expected a non-empty code without spaces or '<>'")
    return f"<2{lang}>"


__all__ = [
    "PAD", "UNK", "BOS", "EOS",
    "PAD_PIECE", "UNK_PIECE", "BOS_PIECE", "EOS_PIECE",
    "SPECIAL_PIECES", "NUM_SPECIAL", "lang_tag",
]
