"""Request bodies to prompt token ids: completions as given, chat through the model's template.

User text never becomes control tokens: the model's special tokens (``<|im_start|>`` …) come only from the chat
template, and text inside a message that spells one is encoded as plain text, as if it held no special meaning.
These functions run on a worker thread (tokenizing a large body would stall the event loop).
"""

from __future__ import annotations

import re

from spear.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError

# A token spells at most as many characters as its vocabulary entry has; a normalizer (NFC, say) may merge a few
# characters into one. Text longer than context × longest entry × this cannot fit and is refused untokenized:
# tokenizing 3.5 MB took 14 s on a busy 2-core CPU, and freeing its Encoding held the GIL (every thread) for 0.36 s.
NORMALIZER_SLACK = 4


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab = len(tokenizer)
        self.special_texts = tuple(t for t in tokenizer.all_special_tokens if t)
        self.max_chars = max_model_len * max(map(len, tokenizer.get_vocab())) * NORMALIZER_SLACK

    def completion(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            self._not_surely_too_long(len(req.prompt), "prompt")
            return self._fitting(self._encode(req.prompt, add_special_tokens=True), "prompt")
        bad = [t for t in req.prompt if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})", "prompt")
        return self._fitting(list(req.prompt), "prompt")

    def _encode(self, text: str, add_special_tokens: bool):
        """Token ids, or for a fast tokenizer its Encoding (len() without building the id list). encode_batch lets
        other threads run while it works (encode holds the GIL for seconds on a megabyte prompt)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def _not_surely_too_long(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise RequestError(f"the prompt has {chars} characters, more than the model's context of "
                               f"{self.max_model_len} tokens can hold; shorten it", param, code="context_length_exceeded")

    def _fitting(self, encoded, param: str) -> list[int]:
        """The ids, if they leave the context room for one generated token (checked before a long id list is built)."""
        n, limit = len(encoded), self.max_model_len
        if n >= limit:
            raise RequestError(f"the prompt is {n} tokens but the model's context is {limit} tokens; shorten it",
                               param, code="context_length_exceeded")
        return encoded if isinstance(encoded, list) else encoded.ids

    def chat(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        self._not_surely_too_long(sum(len(m["content"]) + len(m.get("name", "")) for m in messages), "messages")
        if not any(self._spells_special(m.get("name", "")) or self._spells_special(m["content"]) for m in messages):
            return self._fitting(self._encode(self._render(messages), add_special_tokens=False), "messages")
        if any(self._spells_special(m.get("name", "")) for m in messages):
            raise RequestError("a message name holds the text of one of the model's special tokens", "messages")
        return self._fitting(self._encode_with_plain_contents(messages), "messages")

    def _spells_special(self, text: str) -> bool:
        return any(s in text for s in self.special_texts)

    def _render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except ValueError as e:  # no chat template, or one that rejects these messages
            raise RequestError(f"cannot apply the model's chat template: {e}; use /v1/completions", "messages") from None

    def _encode_with_plain_contents(self, messages: list[dict]) -> list[int]:
        """Render the template around placeholders, then encode its own text with special tokens parsed and each
        message's content with special tokens split into ordinary text."""
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use code points: no template makes them
        text = self._render([{**m, "content": mark} for m, mark in zip(messages, marks)])
        pieces = re.split("(\ue000\\d+\ue001)", text)
        if pieces[1::2] != marks:  # the template dropped, repeated or reordered a content: cannot place it safely
            raise RequestError("a message holds the text of one of the model's special tokens, which this chat "
                               "template cannot keep as plain text", "messages")
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += self.tokenizer(piece, add_special_tokens=False).input_ids if piece else []
            else:
                content = messages[int(piece[1:-1])]["content"]
                ids += self.tokenizer(content, add_special_tokens=False, split_special_tokens=True).input_ids
        return ids
