"""How a model's prompts become token ids: its tokenizer's own chat template (or plain text when it
has none), the fixed prefix every chat prompt starts with, and the tokens that end an answer.

Nothing here knows a particular model: the template prefix is found by rendering the template
around a marker, so a template that adds a default system prompt (SmolLM2, Qwen2) has it in its
prefix, and one that adds nothing but a BOS token has a one-token prefix.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Sequence, Union

from shared.errors import ConfigError, InvalidRequest

Messages = list[dict]
Prompt = Union[str, Messages]
_MARK = "\u2063MSG\u2063"  # invisible separators: no template or tokenizer touches them


def _render(tok, messages: Messages, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


class PromptFormat:
    """A tokenizer's prompt format. ``encode`` gives (ids, prefix_len): the ids of the whole prompt
    and how many leading ids are the fixed prefix (the same for every prompt of this format, so a
    consumer can hold its own K/V for them)."""

    def __init__(self, tok):
        self.tok = tok
        self.chat = bool(getattr(tok, "chat_template", None))
        self.head, self.tail = "", ""
        self.end_of_turn: int | None = None
        with_special = tok("x", add_special_tokens=True)["input_ids"]
        plain = tok("x", add_special_tokens=False)["input_ids"]
        n = len(with_special) - len(plain)  # the tokenizer's own leading special tokens (BOS), if any
        self.bos_ids: list[int] = list(with_special[:n]) if n > 0 and with_special[n:] == plain else []
        if self.chat:
            try:
                text = _render(tok, [{"role": "user", "content": _MARK}], True)
            except Exception as e:  # noqa: BLE001 - jinja's syntax and runtime errors, a template's own raise
                raise ConfigError(f"the tokenizer's chat template cannot render a user message ({type(e).__name__}: "
                                  f"{str(e)[:200]}); fix or remove the template (chat_template.jinja or "
                                  "tokenizer_config.json's chat_template)") from None
            if text.count(_MARK) != 1:
                raise ConfigError("the tokenizer's chat template does not place the user message verbatim")
            self.head, self.tail = text.split(_MARK)
            self.end_of_turn = self._end_of_turn()
            self.prefix_ids = self._ids(self.head)
        else:  # plain text: the tokenizer's own leading special tokens (BOS) are the fixed prefix
            self.prefix_ids = list(self.bos_ids)

    @property
    def doc_start_id(self) -> int | None:
        """The token a document starts after: the tokenizer's BOS, else its end-of-text (EOS) token.
        A one-token completion prompt is preceded by it, as the start of a new document."""
        for t in (self.tok.bos_token_id, self.tok.eos_token_id):
            if isinstance(t, int):
                return t
        return None

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _end_of_turn(self) -> int | None:
        """The special token the template closes an assistant turn with (e.g. <|im_end|>), if any."""
        try:
            text = _render(self.tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}], False)
        except Exception:  # noqa: BLE001 - some templates refuse a lone assistant turn; EOS then ends answers
            return None
        after = text.split(_MARK, 1)[1] if _MARK in text else ""
        ids = self._ids(after)
        if ids and ids[0] in set(getattr(self.tok, "all_special_ids", ())) | set(self.tok.get_added_vocab().values()):
            return ids[0]
        return None

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 (16 hex) of the vocabulary, the special tokens and the chat template: two formats
        with the same fingerprint encode every prompt to the same ids."""
        h = hashlib.sha256(json.dumps(sorted(self.tok.get_vocab().items())).encode())
        h.update(json.dumps([str(getattr(self.tok, "chat_template", None) or ""), self.tok.all_special_tokens,
                             self.bos_ids]).encode())
        return h.hexdigest()[:16]

    # ------------------------------------------------------------------ prompts
    def encode_text(self, text: str) -> tuple[list[int], int]:
        """Plain text, no chat template (language-modelling data): the tokenizer's BOS, then the text."""
        return self.bos_ids + self._ids(text), len(self.bos_ids)

    def encode(self, prompt: Prompt) -> tuple[list[int], int]:
        """(token ids, prefix length) of a prompt given as text (a user message, wrapped in the chat
        template when the tokenizer has one) or as a list of chat messages."""
        if isinstance(prompt, str):
            if not self.chat:
                return self.encode_text(prompt)
            return self.prefix_ids + self._ids(prompt + self.tail), len(self.prefix_ids)
        if not self.chat:
            raise InvalidRequest("this model's tokenizer has no chat template; send the prompt as text")
        check_messages(prompt)
        try:
            text = _render(self.tok, prompt, True)
        except Exception as e:  # noqa: BLE001 - jinja errors: the template refuses these messages
            raise InvalidRequest(f"the chat template refuses these messages: {e}") from None
        if self.head and text.startswith(self.head):  # the usual case: the fixed prefix, tokenized on its own
            return self.prefix_ids + self._ids(text[len(self.head):]), len(self.prefix_ids)
        return self._ids(text), 0

    def answer_ids(self, answer: str) -> list[int]:
        """A gold answer as the model should generate it: its tokens, then the end-of-answer token."""
        end = self.end_of_turn if self.end_of_turn is not None else self.tok.eos_token_id
        return self._ids(answer) + ([end] if end is not None else [])

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end an answer: EOS and the template's end-of-turn token."""
        out: list[int] = []
        eos = self.tok.eos_token_id
        for t in ([eos] if isinstance(eos, int) else list(eos or [])) + [self.end_of_turn]:
            if t is not None and t not in out:
                out.append(int(t))
        return out


def check_messages(messages: Sequence) -> None:
    """A list of {"role": str, "content": str} with at least one message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {\"role\", \"content\"} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequest(f"message {i} must be an object with string \"role\" and \"content\"")
