"""Incremental detokenization of one sequence's output, cut at the first stop string.

Text is decoded from a few tokens before the new ones (so tokenizers that merge or drop
leading spaces decode correctly) and only once it no longer ends in an incomplete UTF-8
character. Text that could still be the start of a stop string is held back.
"""

from __future__ import annotations

CONTEXT_TOKENS = 5


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        self.text = ""  # the output's text so far (ends before a stop string once one is found)
        self.emitted = 0  # characters of text handed out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> bool:
        """Append one output token; True when the text now contains a stop string."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        # A match cannot start in emitted text: it would have been held back as a stop-string prefix.
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def take(self, final: bool) -> str:
        """New text to hand out: all of it when final, else all but a possible stop-string prefix at the end."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._held())
        new, self.emitted = self.text[self.emitted:end], end
        return new

    def _held(self) -> int:
        return max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
