"""When a sequence stops: max_new_tokens, EOS ids, stop token sequences, stop strings.

A speculative step commits several tokens at once; :meth:`StopCriteria.scan` walks them one
by one so nothing past a stop is ever emitted (the stopping token itself is kept, as in
transformers).

Stop strings are matched on a decoded *window* at the end of the text, grown by characters
(not by a fixed number of tokens): a character may take several tokens (byte fallback,
byte-level BPE), and a token many characters. A window that holds the whole generated text is
decoded after the prompt's last token, whose text is then cut off: a SentencePiece decoder strips
the leading space of a text's first token, which the first generated token keeps after a prompt.
A byte-fallback decoder (Llama's, Mistral's) turns a whole run of byte tokens into U+FFFDs where the run is not
valid UTF-8: a window starting inside a character grows, and the prompt's anchor starts at a whole character.
A decoder that strips the text's end (transformers 5's SentencePieceBackend) drops the space of a last lone "▁": it
is put back from the tokens' pieces, so that a stop string ending in a space stops where a fast tokenizer stops.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.errors import InputError

# A window decoded on its own may differ from the full text in its first few characters
# (a UTF-8 sequence cut in two decodes to U+FFFD, a SentencePiece leading space is stripped):
# those characters are never matched. 8 > the 3 continuation bytes of a cut UTF-8 character.
WINDOW_SLACK_CHARS = 8
# A character whose last bytes are still to come decodes to U+FFFD at the text's end: not matched there (a stop
# string holding U+FFFD stopped on every half-generated emoji); a real U+FFFD there is matched one token later.
CUT = "\ufffd"
UTF8_MAX_BYTES = 4  # a character takes at most this many byte tokens
SPACE_PIECE = "\u2581"  # SentencePiece's "▁", a space in a token's piece


@dataclass(frozen=True)
class StopCriteria:
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences
    stop_strings: tuple[str, ...] = ()  # matched on decoded text, needs `tokenizer`
    tokenizer: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(len(s) == 0 for s in self.stop_sequences) or any(s == "" for s in self.stop_strings):
            raise InputError("stop sequences and stop strings must be non-empty")
        if self.stop_strings and self.tokenizer is None:
            raise InputError(f"stop strings need a tokenizer (the model has none: pass tokenizer=...), or pass "
                             f"token-id stop sequences instead of {list(self.stop_strings)[:3]}")

    def scan(self, tokens: Sequence[int], committed: Sequence[int], start: int = 0) -> tuple[int, str | None]:
        """How many of `committed` (appended after ``tokens``, of which ``tokens[start:]`` were generated) to emit,
        and why it stopped.

        Returns (count, reason) with reason in {None, "eos", "stop", "length"}. Only the tokens a check reads are
        copied (the last stop sequence's length, or every generated token for stop strings): this runs per
        sequence per step.
        """
        generated = len(tokens) - start
        max_seq = max((len(s) for s in self.stop_sequences), default=0)
        max_chars = max((len(s) for s in self.stop_strings), default=0)
        keep = generated if max_chars else min(generated, max(max_seq - 1, 0))
        history = list(tokens[len(tokens) - keep :]) if keep else []
        anchor, anchor_text = self._anchor(tokens, start) if max_chars else ([], "")
        # tokens decoded per stop-string check: enough at >= 1 character per token, else it grows
        window = max_chars + WINDOW_SLACK_CHARS + 2
        # a stripped space at the end completes only a stop string that ends in one
        spaced_end = any(s.endswith(" ") for s in self.stop_strings)
        for i, tok in enumerate(committed):
            history.append(tok)
            if tok in self.eos_token_ids:
                return i + 1, "eos"
            if max_seq and any(tuple(history[-len(s) :]) == s for s in self.stop_sequences):
                return i + 1, "stop"
            if max_chars:
                tail, window = self._tail(history, window, max_chars, anchor, anchor_text)
                tail = tail.rstrip(CUT)
                if spaced_end:
                    tail += self._stripped_spaces(history, tail)
                if any(s in tail for s in self.stop_strings):
                    return i + 1, "stop"
            if generated + i + 1 >= self.max_new_tokens:
                return i + 1, "length"
        return len(committed), None

    def _stripped_spaces(self, history: list[int], text: str) -> str:
        """The spaces of the text's last "▁" pieces that its decode stripped off its end (module doc): a lone "▁"
        decodes to nothing there, and its space came only with the next token, a stop string ending in one a token
        late. "" where the tokenizer has no pieces (convert_ids_to_tokens) or kept them."""
        to_piece = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if to_piece is None:
            return ""
        spaces = 0
        for tok in reversed(history):
            piece = to_piece(tok)
            if not isinstance(piece, str):
                break
            spaces += len(piece) - len(piece.rstrip(SPACE_PIECE))
            if piece.strip(SPACE_PIECE):  # a piece with other text ends the run of spaces
                break
        return " " * max(0, spaces - (len(text) - len(text.rstrip(" "))))

    def _anchor(self, tokens: Sequence[int], start: int) -> tuple[list[int], str]:
        """The prompt's last token and its text, decoded before a whole generated text (module doc); its last few
        tokens where that one alone is part of a character (a prompt ending in an emoji of byte-fallback tokens,
        whose last byte alone decodes to U+FFFD, and garbled the generated bytes after it with it)."""
        anchor: list[int] = []
        text = ""
        for first in range(start - 1, max(start - UTF8_MAX_BYTES, 0) - 1, -1):
            anchor = list(tokens[first:start])
            text = self.tokenizer.decode(anchor, skip_special_tokens=False)
            if CUT not in text:
                break
        return anchor, text

    def _tail(self, history: list[int], window: int, max_chars: int, anchor: list[int],
              anchor_text: str) -> tuple[str, int]:
        """(text, window): the end of the decoded text holding every stop-string match that the
        last token completed, and the token window used (doubled until it covers the match).
        ``anchor``: the prompt's last token, decoded before a whole text and cut off (``anchor_text``, module doc)."""
        decode = self.tokenizer.decode
        while True:
            start = max(0, len(history) - window)
            if start == 0:  # the whole text: nothing to trim but the anchor's text
                if anchor:
                    anchored = decode(anchor + history, skip_special_tokens=False)
                    if anchored.startswith(anchor_text):  # else the two merged into one character: decoded alone
                        return anchored[len(anchor_text):], window
                return decode(history, skip_special_tokens=False), window
            text = decode(history[start:], skip_special_tokens=False)
            # a match the last token completed ends past the prefix shared with the text without
            # that token, so it starts past prefix - max_chars >= the slack: it lies in text[slack:]
            before = decode(history[start:-1], skip_special_tokens=False)
            # a byte-fallback decoder (Llama's, Mistral's) turns every byte of a run of byte tokens into U+FFFD when the
            # run does not decode whole: a window starting inside a character loses the characters after it too
            garbled = len(text) - len(text.lstrip(CUT))
            if (garbled <= WINDOW_SLACK_CHARS
                    and len(os.path.commonprefix([before, text])) >= max_chars + WINDOW_SLACK_CHARS):
                return text[WINDOW_SLACK_CHARS:], window
            window *= 2
