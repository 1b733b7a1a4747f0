"""The built-in training prompt set: a few hundred varied chat prompts, generated programmatically.

Used by ``specdec train-medusa`` when no ``--data`` is given (self-distillation from prompts).
Built from templates x subjects so it is varied yet reproducible; it is disjoint from the
held-out evaluation chat prompts (``specdec.eval.prompts.CHAT``), which is checked at import.

    from specdec.train.prompts import builtin_prompts
    prompts = builtin_prompts()          # list[str], deterministic order
"""
from __future__ import annotations

import random

SUBJECTS = (
    "volcanoes", "the stock market", "black holes", "compound interest", "the French Revolution", "sourdough bread",
    "electric cars", "honeybees", "the immune system", "machine learning", "coral reefs", "the Roman Empire",
    "solar panels", "jazz music", "time management", "public speaking", "chess openings", "the human heart",
    "climate change", "cloud computing", "the printing press", "marathon training", "composting", "inflation",
    "the moon landing", "quantum computers", "meditation", "origami", "glaciers", "the internet", "earthquakes",
    "renewable energy", "the Renaissance", "sleep", "budgeting", "tea", "rainforests", "databases", "bridges",
    "the periodic table", "birds migrating", "unit testing", "gardening in small spaces", "the Great Wall of China",
    "photography", "first aid", "recycling", "the stock exchange", "DNA", "mountain climbing",
)

TEMPLATES = (
    "Explain {s} to a ten-year-old.",
    "Give me three interesting facts about {s}.",
    "Write a short paragraph about {s}.",
    "What are the pros and cons of {s}?",
    "Write a limerick about {s}.",
    "What is a common misconception about {s}?",
    "Summarise the history of {s} in a few sentences.",
    "How would you teach a beginner about {s}?",
    "List five questions a student might ask about {s}.",
    "Describe {s} in simple terms.",
)

GENERIC = (
    "Write a polite email asking a colleague for feedback on a report.",
    "How can I make my mornings more productive?",
    "What is the difference between RAM and storage?",
    "Write a Python function that reverses a string.",
    "Give me a recipe for a quick tomato pasta.",
    "How do I write a good cover letter?",
    "Explain what an API is with an example.",
    "What are some tips for staying focused while studying?",
    "Write a short story opening about a lighthouse keeper.",
    "How do I convert Celsius to Fahrenheit?",
    "What is the difference between a virus and a bacterium?",
    "Suggest a weekly exercise plan for a beginner.",
    "Explain the rules of tic-tac-toe.",
    "Write a thank-you note to a teacher.",
    "How does a refrigerator keep food cold?",
    "What is a prime number? Give examples.",
)


def builtin_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """All (or the first ``n``, shuffled with ``seed``) built-in prompts."""
    prompts = list(GENERIC) + [t.format(s=s) for s in SUBJECTS for t in TEMPLATES]
    random.Random(seed).shuffle(prompts)
    return prompts if n is None else prompts[:n]


def _check_disjoint() -> None:
    from specdec.eval.prompts import CHAT

    overlap = set(CHAT) & set(builtin_prompts())
    if overlap:  # pragma: no cover - guards future edits
        raise RuntimeError(f"built-in training prompts overlap the held-out chat prompts: {sorted(overlap)}")


_check_disjoint()
