"""Conversations through the acceptance suite: turn k's prompt is the conversation so far.

    codec = chat_codec(loaded)                       # messages -> prompt ids, answer ids -> text
    cells = run_conversations(loaded, conversations, codec, config, out)

Every turn is measured as its own cell, named ``<category>.turn<k>`` when the category holds a conversation of more
than one turn (else the category's name). Turn k's prompt is the chat template over the system messages, the user
turns 1..k and the model's answers to turns 1..k-1. Each answer is the model's own: specdec's plain decoding of that
turn's prompt with the run's sampling and seed, one conversation at a time, exactly the plain cell's answer at batch
size 1, so every drafter is measured on the same history, greedy or seeded. The answers are decoded again for every
run, a resume included (nothing read back is trusted); ``<out>/conversations.json`` shows them.

A run's settings record the conversations (texts and categories) and the first turns' prompt ids (which fix the
tokenizer and chat template), the same for every turn, so a resume checks every turn's cells against them, all of them
before the first turn is measured.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.eval.acceptance import Cell, SuiteConfig, check_resume, run_suite
from specdec.eval.prompt_files import Conversation, cell_turns, turn_cell

from specdec.atomic_write import write_json
from specdec.generate import generate
from specdec.generate_inputs import check_encoded

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class ChatCodec:
    encode: Callable[[Messages], list[int]]  # a conversation ending in a user turn -> the prompt's ids
    decode: Callable[[list[int]], str]  # an answer's new tokens -> its text, for the next turn's prompt


def chat_codec(loaded: Any) -> ChatCodec:
    """The model's chat template (or, without one, the turns joined by blank lines). A model without a tokenizer
    (tiny test models) folds bytes into its vocabulary and decodes ids to characters that fold back to them."""
    tok = loaded.tokenizer
    if tok is None:
        vocab = loaded.runner.shape.vocab_size
        base = vocab * math.ceil(48 / vocab)  # base % vocab == 0: the character of id i folds back to i
        fold = lambda text: [b % vocab for b in text.encode()][:256] or [0]  # noqa: E731
        return ChatCodec(lambda messages: fold("\n".join(m["content"] for m in messages)),
                         lambda ids: "".join(chr(base + int(i)) for i in ids))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    if getattr(tok, "chat_template", None):
        return ChatCodec(lambda messages: list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                       return_dict=False)), decode)

    def encode(messages: Messages) -> list[int]:
        text = "\n\n".join(m["content"] for m in messages)
        return check_encoded(text, tok(text)["input_ids"])

    return ChatCodec(encode, decode)


def _built_in_index(conversations: list[Conversation], i: int) -> int | None:
    """Conversation ``i``'s place (1-based) among the built-in prompts of its category; None for a file's."""
    c = conversations[i]
    return sum(d.category == c.category for d in conversations[:i]) + 1 if c.where.startswith("built-in") else None


def prompt_name(conversations: list[Conversation], i: int, turn: int = 1) -> str:
    """Conversation ``i`` as a message names it: its file and line, or its place among the built-in prompts of its
    category; ``turn`` (1-based) where it has several."""
    c, k = conversations[i], _built_in_index(conversations, i)
    name = (c.where or f"conversation {i + 1}") + ("" if k is None else f" prompt {k}")
    return name + (f" turn {turn}" if len(c.turns) > 1 else "")


def check_prompts_fit(loaded: Any, conversations: list[Conversation], ids: dict[int, list[int]], turn: int,
                      max_new_tokens: int, answered: dict[int, int] | None = None) -> None:
    """Refuse, naming it, a prompt (``ids``: conversation index -> turn ``turn``'s prompt ids) whose answer of
    ``max_new_tokens`` would run past the model's context: before its cells are measured, not inside one.
    ``answered``: conversation index -> the new tokens of the model's answers to its earlier turns, which the prompt
    holds; a lower --max-new-tokens shortens them too, so the value advised leaves room for every answer."""
    shape = loaded.runner.shape
    limit = shape.max_positions  # the context, or the sliding window + 1 where smaller
    for i, prompt in ids.items():
        if len(prompt) + max_new_tokens <= limit:  # the advice below is worked out for a prompt that does not fit
            continue
        k = _built_in_index(conversations, i)
        leave = ("leave it out of the file" if k is None else f"--prompts {k - 1} leaves it out" if k > 1 else
                 f"leave {conversations[i].category} out of --categories")
        earlier = (answered or {}).get(i, 0)
        # turn - 1 earlier answers and this one, each at most the advised count
        fits = (limit - len(prompt) + earlier) // (turn if earlier else 1)
        also = " (the answers of its earlier turns shorten with it)" if earlier else ""
        shape.check_answer_fits(prompt_name(conversations, i, turn), len(prompt), "--max-new-tokens", max_new_tokens,
                                fits, also, leave)


def system_messages(c: Conversation) -> Messages:
    """The messages a conversation opens with, before its first turn: its system messages, in file order."""
    return [{"role": "system", "content": s} for s in c.system]


def first_turn_ids(codec: ChatCodec, c: Conversation) -> list[int]:
    """The token ids of a conversation's first prompt: its system messages, then its first user turn."""
    return codec.encode([*system_messages(c), {"role": "user", "content": c.turns[0]}])


def check_first_turns_fit(loaded: Any, conversations: list[Conversation], codec: ChatCodec,
                          max_new_tokens: int) -> None:
    """:func:`check_prompts_fit` over every conversation's first turn, before the run measures anything (a later
    turn's prompt holds the model's answers, so it is checked when its turn comes)."""
    ids = {i: first_turn_ids(codec, c) for i, c in enumerate(conversations)}
    check_prompts_fit(loaded, conversations, ids, 1, max_new_tokens)


def run_conversations(loaded: Any, conversations: list[Conversation], codec: ChatCodec, config: SuiteConfig,
                      out: Path, resume: bool = False, on_progress: Callable[[str, Cell], None] | None = None,
                      on_turn: Callable[[int, int], None] | None = None) -> dict[tuple[str, str], Cell]:
    """Measure every turn of every conversation (one :func:`run_suite` per turn); cells keyed by (row, cell name).
    ``on_turn(k, answers)``: called before the model answers turn ``k`` of ``answers`` conversations."""
    if not conversations:
        raise ValueError("run_conversations needs at least one conversation")
    names = cell_turns(conversations)  # two categories writing one cell are refused
    multi = {c.category for c in conversations if len(c.turns) > 1}
    first: dict[str, list[list[int]]] = {}
    for c in conversations:
        first.setdefault(turn_cell(c.category, 1, c.category in multi), []).append(first_turn_ids(codec, c))
    identity = {"conversations": [[c.category, list(c.system), list(c.turns)] for c in conversations],
                "first_turns": first}
    if resume:  # every turn's finished cells, before the first turn is measured again
        check_resume(loaded, config, out, list(names), identity)
    history: list[Messages] = [system_messages(c) for c in conversations]
    answered = dict.fromkeys(range(len(conversations)), 0)  # the new tokens of each one's answers so far
    sampling = config.generate_kwargs
    cells: dict[tuple[str, str], Cell] = {}
    shown: list[dict] = [{"category": c.category, "where": c.where, "turns": []} for c in conversations]
    for t in range(max(len(c.turns) for c in conversations)):
        active = [i for i, c in enumerate(conversations) if t < len(c.turns)]
        prompts: dict[str, list[list[int]]] = {}
        ids = {}
        for i in active:
            history[i].append({"role": "user", "content": conversations[i].turns[t]})
            ids[i] = codec.encode(history[i])
            prompts.setdefault(turn_cell(conversations[i].category, t + 1, conversations[i].category in multi),
                               []).append(ids[i])
        check_prompts_fit(loaded, conversations, ids, t + 1, config.max_new_tokens, answered)  # before its cells
        cells.update(run_suite(loaded, prompts, config, out, resume, on_progress, prompts_identity=identity))
        answering = [i for i in active if t + 1 < len(conversations[i].turns)]
        if answering and on_turn:
            on_turn(t + 1, len(answering))
        for i in active:
            answer = None
            if i in answering:
                new = generate(loaded, [ids[i]], max_new_tokens=config.max_new_tokens, return_dict=True,
                               **sampling).new_tokens[0]
                answer = codec.decode(list(new))
                answered[i] += len(new)
                history[i].append({"role": "assistant", "content": answer})
            shown[i]["turns"].append({"prompt_ids": ids[i], "answer": answer})
    try:
        from accelerate import PartialState

        main = PartialState().is_main_process
    except ImportError:
        main = True
    if main:
        write_json(out / "conversations.json", {"conversations": shown}, indent=1)
    return cells
