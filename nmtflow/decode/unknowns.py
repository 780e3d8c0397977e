"""Input pieces that the source vocabulary lacks (``<unk>``): counted over a translation, reported once."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from nmtflow.data.tokenizer import Tokenizer
from nmtflow.data.vocab import UNK

log = logging.getLogger(__name__)

#: distinct unknown texts a warning quotes
EXAMPLES = 5


@dataclass
class UnknownTally:
    """How many input sentences, and pieces, encode to ``<unk>``; :meth:`warn` reports them in one warning."""

    sentences: int = 0  # input sentences seen
    with_unknown: int = 0  # of them, those with an <unk> piece
    pieces: int = 0  # <unk> pieces in all
    examples: list[str] = field(default_factory=list)  # the first few distinct texts that became <unk>
    tokenizer: Tokenizer | None = None

    def add(self, tokenizer: Tokenizer, lines: list[str], ids: list[list[int]]) -> None:
        """Count the <unk> pieces of ``ids``, the encoding of ``lines`` by ``tokenizer``."""
        self.tokenizer = tokenizer
        self.sentences += len(ids)
        for line, seq in zip(lines, ids):
            if UNK not in seq:
                continue
            self.with_unknown += 1
            self.pieces += seq.count(UNK)
            if len(self.examples) < EXAMPLES:  # the texts: encoding again, only for a few sentences
                for text in tokenizer.unknown_surfaces(line):
                    if text not in self.examples and len(self.examples) < EXAMPLES:
                        self.examples.append(text)

    def message(self, name: str | None = None) -> str | None:
        """The warning (``name``: the input's file), or None when every piece was known."""
        if not self.with_unknown:
            return None
        quoted = ", ".join(repr(text) for text in self.examples)
        why = "" if self.tokenizer is None or self.tokenizer.byte_fallback else \
            "; the source tokenizer has no byte fallback: one prepared with it spells unseen characters as bytes"
        return (f"{name + ': ' if name else ''}{self.with_unknown} of {self.sentences} input sentences contain pieces "
                f"unknown to the source vocabulary ({self.pieces} piece{'s' * (self.pieces != 1)}: {quoted}); they "
                f"are translated as <unk>{why}")

    def warn(self, name: str | None = None) -> None:
        """Log :meth:`message` as a warning, if there is one."""
        if (text := self.message(name)) is not None:
            log.warning("%s", text)


__all__ = ["UnknownTally"]
