"""StopCriteria: a multi-token commit never emits anything past a stop."""
from __future__ import annotations

import pytest

from specdec.stopping import StopCriteria


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_eos_inside_a_commit_truncates_after_it():
    stop = StopCriteria(100, frozenset({7}))
    assert stop.scan([1, 2], [3, 7, 4, 5]) == (2, "eos")


def test_max_new_tokens_inside_a_commit():
    stop = StopCriteria(5)
    assert stop.scan([1, 2, 3], [4, 5, 6, 7]) == (2, "length")
    assert stop.scan([], [1, 2]) == (2, None)


def test_stop_sequence_spanning_history_and_commit():
    stop = StopCriteria(100, stop_sequences=((3, 4, 5),))
    assert stop.scan([1, 3, 4], [5, 6]) == (1, "stop")
    assert stop.scan([1, 3], [4, 6, 5]) == (3, None)


def test_tokens_before_start_are_the_prompt_for_every_check():
    """The engine passes a sequence's whole token list and where its generated tokens start: the prompt counts for
    no check (the length, a stop sequence or a stop string straddling it), as when only the generated tokens were
    passed."""
    prompt = [9, 3, 4]
    for stop, generated, committed in [
        (StopCriteria(5), [1, 2, 3], [4, 5, 6, 7]),
        (StopCriteria(100, stop_sequences=((3, 4, 5),)), [], [5, 6, 3, 4, 5, 1]),
        (StopCriteria(100, stop_sequences=((4, 5),)), [1] * 40 + [4], [5, 6]),
        (StopCriteria(100, stop_strings=("dfg",), tokenizer=CharTokenizer()), [], [5, 6, 3, 5, 6]),
    ]:
        alone = stop.scan(generated, committed)
        assert stop.scan(prompt + generated, committed, start=len(prompt)) == alone, (stop, alone)
    assert StopCriteria(100, stop_sequences=((3, 4, 5),)).scan(prompt, [5], start=len(prompt)) == (1, None)
    assert StopCriteria(100, stop_sequences=((3, 4, 5),)).scan(prompt, [5], start=1) == (1, "stop")


def test_stop_string_across_token_boundaries():
    stop = StopCriteria(100, stop_strings=("cde",), tokenizer=CharTokenizer())
    assert stop.scan([0, 2], [3, 4, 5]) == (2, "stop")  # "a c | d e f": stops at "e"


class SentencePieceLike:
    """Tokens of words with their leading space (SentencePiece's "▁"); a decoded text loses its first space, as
    transformers' LlamaTokenizer decoder (``Strip(left=1)``) does."""

    words = ["<s>", " a", " b", ":", " User"]

    def decode(self, ids, skip_special_tokens=False):
        text = "".join(self.words[i] for i in ids)
        return text[1:] if text.startswith(" ") else text


def test_a_stop_string_with_a_leading_space_at_the_first_new_token():
    """" User:" completed by the first two new tokens was missed (the generated text, decoded alone, starts "User:"),
    and generation ran on; transformers stops there. The prompt's own text still counts for no match."""
    stop = StopCriteria(100, stop_strings=(" User:",), tokenizer=SentencePieceLike())
    prompt = [0, 1, 2]
    assert stop.scan(prompt, [4, 3, 1], start=len(prompt)) == (2, "stop")
    assert stop.scan(prompt + [4], [3, 1], start=len(prompt)) == (1, "stop")
    assert stop.scan(prompt + [1], [4, 3], start=len(prompt)) == (2, "stop")
    assert StopCriteria(100, stop_strings=("b:",), tokenizer=SentencePieceLike()).scan(
        prompt, [3, 1], start=len(prompt)) == (2, None)  # " b" is the prompt's


class ByteTokenizer:
    """Token i is the byte i (byte-level BPE at its simplest): a character cut after some of its bytes decodes to
    U+FFFD, as transformers' byte-level decoders give it."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_stop_string_holding_u_fffd_waits_for_a_character_to_end():
    """A stop string holding U+FFFD matched the placeholder of a character half generated: an emoji's first two
    bytes ended the text in a broken character, where transformers never stops. A real U+FFFD is matched when the
    token after it has come."""
    stop = StopCriteria(100, stop_strings=("\ufffd",), tokenizer=ByteTokenizer())
    emoji = list("🌍".encode())
    assert stop.scan(list(b"ok "), emoji + list(b"!")) == (5, None)
    assert stop.scan(list(b"ok "), emoji[:2]) == (2, None)
    real = list("\ufffd".encode())  # the character itself, bytes EF BF BD
    assert stop.scan([], real + list(b"a")) == (4, "stop")
    assert stop.scan([], [0xFF, 0x61]) == (2, "stop")  # an invalid byte: U+FFFD once the next one came
    assert StopCriteria(100, stop_strings=("o",), tokenizer=ByteTokenizer()).scan([], list(b"no") + emoji) \
        == (2, "stop")


def test_invalid_criteria():
    with pytest.raises(ValueError):
        StopCriteria(0)
    with pytest.raises(ValueError, match="tokenizer"):
        StopCriteria(5, stop_strings=("x",))
    with pytest.raises(ValueError):
        StopCriteria(5, stop_sequences=((),))


def _byte_level_tokenizer():
    """GPT-2 style byte-level tokenizer without merges: every UTF-8 byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class CountingTokenizer:
    """Wraps a tokenizer; records the length of every decoded window."""

    def __init__(self, inner):
        self.inner, self.lengths = inner, []

    def decode(self, ids, skip_special_tokens=False):
        self.lengths.append(len(ids))
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("stop_string", ["😀", "😀😀", "é😀", "x😀"])
def test_stop_string_of_many_tokens_per_character(stop_string):
    tok = _byte_level_tokenizer()
    ids = tok.encode("hello " * 50 + stop_string + " tail").ids
    end = len(tok.encode("hello " * 50 + stop_string).ids)  # the stop string's last byte is token end - 1
    assert end - len(tok.encode("hello " * 50).ids) >= 4  # the stop string spans >= 4 tokens
    counting = CountingTokenizer(tok)
    stop = StopCriteria(1000, stop_strings=(stop_string,), tokenizer=counting)
    for cut in (end - 6, end - 3, end - 1):  # the stop string split between history and commit
        assert stop.scan(ids[:cut], ids[cut:]) == (end - cut, "stop")
    assert stop.scan([], ids[: end - 1]) == (end - 1, None)  # one byte short: no stop yet
    assert max(counting.lengths) < 64  # windows stay short: no step decodes the whole text


def test_stop_string_inside_a_long_token_right_after_history():
    class WordTokenizer:
        words = ["X", "abcdefghij", "Y"]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.words[i] for i in ids)

    stop = StopCriteria(100, stop_strings=("Xab",), tokenizer=WordTokenizer())
    assert stop.scan([2, 2, 0], [1, 2]) == (1, "stop")
    assert stop.scan([2] * 30 + [0], [1]) == (1, "stop")


def test_the_unreachable_minimum_warning_says_a_stop_still_ends_a_sequence(caplog):
    """min_new_tokens above max_new_tokens: the warning said every sequence runs to max_new_tokens, but a stop
    string or sequence still ends one there (as in transformers)."""
    import specdec
    from specdec.testing import build_tiny_model

    model = build_tiny_model()
    for stop, said in ((None, False), ([[5]], True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="specdec"):
            specdec.generate(model, [[1, 2, 3]], max_new_tokens=3, min_new_tokens=9, stop=stop)
        assert "EOS is never allowed" in caplog.text
        assert ("unless a stop string or stop sequence ends it" in caplog.text) is said, stop


def test_an_eos_that_also_ends_a_stop_sequence_is_reported_as_eos():
    """The token is the model's end of text: finish_reason says "eos", whatever else it completes."""
    stop = StopCriteria(100, frozenset({5}), stop_sequences=((4, 5),))
    assert stop.scan([4], [5, 6]) == (1, "eos")  # 4 then 5: both the stop sequence and an EOS at the first token


def test_a_one_token_prompt_anchors_a_stop_string_with_a_leading_space():
    """A prompt of one token (a lone BOS) is still decoded before the generated text, so " User:" at the first new
    token keeps its space and matches: "<s>" + " User" + ":" cut after "<s>" is " User:", a stop at token 2."""
    stop = StopCriteria(100, stop_strings=(" User:",), tokenizer=SentencePieceLike())
    assert stop.scan([0], [4, 3, 1], start=1) == (2, "stop")


def test_a_prompt_token_merged_with_the_first_new_token_leaves_the_generated_text_decoded_alone():
    """The prompt ends with the first byte of "é" (C3) and the first new token is its second (A9): decoded together
    they are one character, so the generated text is decoded alone, "\\ufffd!" (what decode(new_tokens) shows), and
    a stop string "\\ufffd!" matches at the second new token; cutting one character off "é!" left "!" and missed it."""
    stop = StopCriteria(100, stop_strings=("\ufffd!",), tokenizer=ByteTokenizer())
    assert stop.scan([0x41, 0xC3], [0xA9, 0x21], start=2) == (2, "stop")


def test_a_long_texts_window_that_starts_inside_a_character_matches_nothing_there():
    """Past the first window the text is decoded from a token that may be a UTF-8 continuation byte, whose U+FFFD
    is not in the text: "é" * 12 + "ab" holds no U+FFFD, so a stop string "\\ufffd" never stops it (2 tokens, no
    reason: 26 of 100 tokens)."""
    stop = StopCriteria(100, stop_strings=("\ufffd",), tokenizer=ByteTokenizer())
    assert stop.scan(list("é".encode()) * 12, list(b"ab")) == (2, None)


def _byte_fallback_tokenizer():
    """Llama / Mistral style: ASCII letters and the space are tokens, every other character its UTF-8 bytes as
    ``<0xNN>`` tokens, which tokenizers' ByteFallback decoder turns into U+FFFD *each* where a run of them is not
    valid UTF-8 as a whole: decoded from inside an emoji, the characters after it are lost too."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({c: 256 + i for i, c in enumerate(" abcdefghijklmnopqrstuvwxyz")})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def test_a_window_starting_inside_a_byte_fallback_character_still_matches_the_characters_after_it():
    """The window of a long text started inside an emoji of byte tokens, and decoding it turned the emoji after
    it into U+FFFDs too: a stop string "🏽 c" never matched, and generation ran past it."""
    tok = _byte_fallback_tokenizer()
    ids = tok.encode("ab" * 20 + "👍" * 4 + "🏽 ca").ids
    assert tok.decode(ids[-14:]).startswith("\ufffd" * 8)  # the window's start lost the emoji after it
    stop = StopCriteria(1000, stop_strings=("🏽 c",), tokenizer=tok)
    assert stop.scan(ids[:-2], ids[-2:]) == (1, "stop")
    assert stop.scan([], ids) == (len(ids) - 1, "stop")


def test_a_prompt_ending_in_a_byte_fallback_character_anchors_the_generated_text_whole():
    """The prompt ends in an emoji of byte tokens and the generated text starts with one: its last byte alone, as
    the anchor, turned the generated bytes into U+FFFDs, and a stop string "🌙 h" never matched."""
    tok = _byte_fallback_tokenizer()
    prompt, new = tok.encode("say 🌙").ids, tok.encode("🌙 hello").ids
    stop = StopCriteria(1000, stop_strings=("🌙 h",), tokenizer=tok)
    assert stop.scan(prompt, new, start=len(prompt)) == (6, "stop")
    assert StopCriteria(1000, stop_strings=("y 🌙",), tokenizer=tok).scan(prompt, new, start=len(prompt)) == (
        len(new), None)  # the prompt's own text still counts for no match


class StrippingPieces:
    """SentencePiece pieces decoded as transformers 5's slow SentencePieceBackend decodes them: "▁" -> " ", then the
    text stripped at both ends, so a last lone "▁" decodes to nothing until a later piece follows it."""

    pieces = ["<s>", "▁User", ":", "▁", "h", "i", "▁a"]

    def convert_ids_to_tokens(self, ids):
        return self.pieces[ids] if isinstance(ids, int) else [self.pieces[i] for i in ids]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").strip()


class KeptPieces(StrippingPieces):
    """The same pieces decoded as a fast tokenizer's Metaspace decoder does: only the text's first space dropped."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")


@pytest.mark.parametrize("tokenizer", [StrippingPieces(), KeptPieces()], ids=["slow", "fast"])
def test_a_stop_string_ending_in_a_space_stops_at_the_lone_space_piece_slow_or_fast(tokenizer):
    """"User: " is complete at the lone "▁" after "▁User" ":"; the slow tokenizer's decode stripped that space off the
    text's end, and the stop came a token late, at "h". Both tokenizers stop at the "▁", within a commit, at a
    commit's end, and in a text whose window no longer starts at the first generated token."""
    stop = StopCriteria(100, stop_strings=("User: ",), tokenizer=tokenizer)
    assert stop.scan([0], [1, 2, 3, 4, 5], start=1) == (3, "stop")
    assert stop.scan([0, 1, 2], [3], start=1) == (1, "stop")
    long = [0] + [6] * 40
    assert stop.scan(long + [1, 2], [3, 4], start=1) == (1, "stop")
    assert stop.scan([0], [1, 2, 4, 3, 4], start=1) == (5, None)  # "User:h h": no space after the colon
    assert StopCriteria(100, stop_strings=("a ",), tokenizer=tokenizer).scan([0], [6, 3, 3], start=1) == (2, "stop")
