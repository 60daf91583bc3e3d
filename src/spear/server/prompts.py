"""Request bodies to prompt token ids: completions as given, chat through the model's template.

User text never becomes control tokens: the model's special tokens (``<|im_start|>`` …) come only from the chat
template, and text inside a message that spells one is encoded as plain text, as if it held no special meaning.

The work is bounded by the context, not by the body: text is tokenized in growing prefixes, so refusing a prompt
that cannot fit costs about what its first `max_model_len` tokens cost (a whole 1.3M-character CJK prompt took
5–20 s). Long prompts run on worker threads (`is_long`), short ones where they arrive.
"""

from __future__ import annotations

import re
import threading

from spear.server.protocol import ChatCompletionRequest, CompletionRequest, RequestError

# A token spells at most as many characters as its vocabulary entry has; a normalizer (NFC, say) may merge a few
# characters into one. Text longer than context × longest entry × this cannot fit and is refused untokenized.
NORMALIZER_SLACK = 4
FIRST_CHARS_PER_TOKEN = 8  # the first prefix tokenized: budget × this many characters (text averages 2–5 a token)
PREFIX_GROWTH = 4  # each later prefix this many times longer
# A prefix's last word may tokenize into more pieces than the whole word does: a prefix is over the budget only
# when it is over by more than this many tokens
PREFIX_SLACK_TOKENS = 32
SHORT_PROMPT_CHARS = 2048  # tokenized on the event loop (well under a millisecond); longer ones on a worker thread


class _OverBudget(Exception):
    def __init__(self, tokens: int, exact: bool):
        self.tokens, self.exact = tokens, exact


def _backends_by_split(tokenizer) -> dict[bool, object] | None:
    """A fast tokenizer's backend twice, by split_special_tokens (None for a slow tokenizer)."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        backends = {split: Tokenizer.from_str(backend.to_str()) for split in (False, True)}
    except Exception:  # a component that does not serialize (a custom Python pre-tokenizer): the locked path
        return None
    for split, b in backends.items():
        b.encode_special_tokens = split
    return backends


def _text_chars(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Characters of text the request asks to tokenize: a completion's prompt string (0 for token ids), or every chat
    message's content and name."""
    if isinstance(req, CompletionRequest):
        return len(req.prompt) if isinstance(req.prompt, str) else 0
    return sum(len(m.content) + len(m.name or "") for m in req.messages)


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab = len(tokenizer)
        self.special_texts = tuple(t for t in tokenizer.all_special_tokens if t)
        self.max_chars = max_model_len * max(map(len, tokenizer.get_vocab())) * NORMALIZER_SLACK
        # Whether text that spells a special token encodes it is the backend's state (encode_special_tokens):
        # threads encoding at once each need their own, so keep one backend per setting, never switched
        self._backends = _backends_by_split(tokenizer)
        self._slow_lock = threading.Lock()

    @staticmethod
    def is_long(req: CompletionRequest | ChatCompletionRequest) -> bool:
        """Whether tokenizing `req` may take more than a moment (then it belongs on a worker thread)."""
        return _text_chars(req) > SHORT_PROMPT_CHARS

    def completion(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            self._not_surely_too_long(_text_chars(req), "prompt")
            return self._within_context(lambda: self._encode(req.prompt, self.max_model_len, add_special_tokens=True),
                                        "prompt")
        bad = [t for t in req.prompt if not 0 <= t < self.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})", "prompt")
        if len(req.prompt) >= self.max_model_len:
            raise self._too_long(_OverBudget(len(req.prompt), exact=True), "prompt")
        return list(req.prompt)

    def chat(self, req: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        self._not_surely_too_long(_text_chars(req), "messages")
        if not any(self._spells_special(m.get("name", "")) or self._spells_special(m["content"]) for m in messages):
            text = self._render(messages)
            return self._within_context(lambda: self._encode(text, self.max_model_len, add_special_tokens=False),
                                        "messages")
        if any(self._spells_special(m.get("name", "")) for m in messages):
            raise RequestError("a message name holds the text of one of the model's special tokens", "messages")
        return self._within_context(lambda: self._encode_with_plain_contents(messages), "messages")

    def _encode(self, text: str, budget: int, add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
        """The ids of `text` if fewer than `budget`, else _OverBudget: growing prefixes are tokenized until one is
        over the budget or the whole text is."""
        chars = max(budget, 1) * FIRST_CHARS_PER_TOKEN
        while True:
            prefix = text[:chars]
            ids = self._ids(prefix, add_special_tokens, split_special_tokens)
            whole = len(prefix) == len(text)
            if len(ids) >= budget + (0 if whole else PREFIX_SLACK_TOKENS):
                raise _OverBudget(len(ids), exact=whole)
            if whole:
                return ids
            chars *= PREFIX_GROWTH

    def _ids(self, text: str, add_special_tokens: bool, split_special_tokens: bool) -> list[int]:
        """A fast tokenizer's encode_batch lets other threads run while it works (encode holds the GIL)."""
        if self._backends is None:
            with self._slow_lock:  # split_special_tokens is the tokenizer's state: one call at a time
                return self.tokenizer(text, add_special_tokens=add_special_tokens,
                                      split_special_tokens=split_special_tokens).input_ids
        backend = self._backends[split_special_tokens]
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _not_surely_too_long(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise RequestError(f"the prompt has {chars} characters, more than the model's context of "
                               f"{self.max_model_len} tokens can hold; shorten it", param, code="context_length_exceeded")

    def _within_context(self, encode, param: str) -> list[int]:
        """encode()'s ids, which leave the context room for one generated token."""
        try:
            return encode()
        except _OverBudget as over:
            raise self._too_long(over, param) from None

    def _too_long(self, over: _OverBudget, param: str) -> RequestError:
        tokens = f"{over.tokens}" if over.exact else f"over {over.tokens - PREFIX_SLACK_TOKENS}"
        return RequestError(f"the prompt is {tokens} tokens but the model's context is {self.max_model_len} tokens; "
                            "shorten it", param, code="context_length_exceeded")

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
            try:
                if i % 2 == 0:
                    ids += self._encode(piece, self.max_model_len - len(ids), add_special_tokens=False) if piece else []
                else:
                    content = messages[int(piece[1:-1])]["content"]
                    ids += self._encode(content, self.max_model_len - len(ids), add_special_tokens=False,
                                        split_special_tokens=True)
            except _OverBudget as over:
                raise _OverBudget(len(ids) + over.tokens, over.exact) from None
        return ids
