"""The built-in training prompt set: a few thousand varied chat prompts, generated programmatically.

Used by ``specdec train-medusa`` when no ``--data`` is given (self-distillation from prompts).
Built from request templates x subjects plus standalone tasks, so it is varied yet reproducible.
It is kept apart from the held-out evaluation chat prompts (``specdec.eval.prompts.CHAT``),
checked at import: no prompt is one of them and no subject word-matches any of them, so a
measured tau is never on a topic the heads were trained on.

    from specdec.train.prompts import builtin_prompts
    prompts = builtin_prompts()          # list[str], deterministic order
    prompts = builtin_prompts(400)       # a seeded shuffle's first 400: a mix of every template
"""
from __future__ import annotations

import random
import re

SUBJECTS = (
    "volcanoes", "the stock market", "black holes", "compound interest", "the French Revolution", "electric cars",
    "honeybees", "machine learning", "coral reefs", "the Roman Empire", "solar panels", "jazz music",
    "time management", "public speaking", "chess openings", "the human heart", "cloud computing",
    "the printing press", "marathon training", "composting", "inflation", "the moon landing", "quantum computers",
    "meditation", "origami", "glaciers", "the internet", "earthquakes", "renewable energy", "the Renaissance",
    "sleep", "budgeting", "tea", "rainforests", "databases", "bridges", "the periodic table", "bird migration",
    "unit testing", "gardening in small spaces", "the Great Wall of China", "photography", "first aid",
    "recycling", "DNA", "mountain climbing", "the Silk Road", "coffee", "octopuses", "wind turbines",
    "the Industrial Revolution", "version control with git", "sharks", "the Olympic Games", "penguins",
    "the human brain", "cryptocurrency", "ancient Egypt", "3D printing", "nutrition labels", "the ocean tides",
    "Mars exploration", "supply and demand", "the Amazon river", "noise-cancelling headphones", "yoga",
    "spreadsheets", "the Cold War", "bees and pollination", "lightning", "minimalism", "urban planning",
    "electric guitars", "the metric system", "dinosaurs", "password security", "podcasts", "board games",
    "the Eiffel Tower", "cheese making", "the Milky Way", "typography", "rivers and deltas", "chocolate",
    "the Byzantine Empire", "self-driving cars", "knitting", "the Arctic", "microplastics", "tornadoes",
    "the violin", "open-source software", "elephants", "the Apollo program", "fermentation", "linear algebra",
    "street food", "batteries", "the Maya civilisation", "remote work", "sign language", "deserts",
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
    "Why do people find {s} interesting?",
    "Write a tweet announcing a new documentary about {s}.",
    "What would a beginner's guide to {s} cover?",
    "Give me a fun quiz question about {s}, with the answer.",
    "Compare {s} today with fifty years ago.",
    "What are the biggest open questions about {s}?",
    "Write a two-line poem about {s}.",
    "How does {s} affect everyday life?",
    "Explain {s} in one sentence, then in one paragraph.",
    "What careers involve {s}?",
    "Give me a short outline for a school presentation on {s}.",
    "What are three books or resources to learn about {s}?",
    "Tell me a surprising story involving {s}.",
    "What is the most important thing to know about {s}?",
    "Answer briefly: what should I know about {s}?",
    "Write a product description for a board game about {s}.",
    "What mistakes do people often make with {s}?",
    "Create a short dialogue between a teacher and a student about {s}.",
)

TASKS = (
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
    "Write a Python function that counts the vowels in a string.",
    "How do I ask my manager for a raise?",
    "Write a short motivational message for someone starting a new job.",
    "What is the difference between a simile and a metaphor?",
    "Give me five names for a pet goldfish.",
    "How do I remove a coffee stain from a shirt?",
    "Write a SQL query that selects all users older than 30.",
    "What should I pack for a business trip of three days?",
    "Explain how a credit score works.",
    "Write an apology message for missing a friend's birthday.",
    "How do I start running if I have never exercised?",
    "What is the difference between HTTP and HTTPS?",
    "Plan a one-day itinerary for a visit to a new city.",
    "Write a JavaScript function that checks whether a number is even.",
    "How can I reduce my screen time?",
    "Describe a good morning routine in five steps.",
    "What is the difference between an acid and a base?",
    "Give me a simple explanation of how airplanes fly.",
    "Write a short review of an imaginary restaurant.",
    "How do I care for a houseplant that gets little light?",
    "What are good questions to ask at the end of a job interview?",
    "Explain what a for loop does, with an example in Python.",
    "Write a birthday message for my grandmother.",
    "How do I make a budget for a student?",
    "What are the steps to change a flat bicycle tyre?",
    "Write a short speech for a friend's wedding toast.",
    "Explain the difference between speed and velocity.",
    "Give me three ideas for a science fair project.",
    "How do noise and signal differ in data analysis?",
    "Write a Python class that represents a bank account.",
    "How should I prepare for a long flight?",
    "What is the difference between a debit card and a credit card?",
    "Give me tips for writing clear emails.",
    "Explain what a neural network is in plain words.",
)


def builtin_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """All (or the first ``n``, shuffled with ``seed``) built-in prompts."""
    prompts = list(TASKS) + [t.format(s=s) for s in SUBJECTS for t in TEMPLATES]
    random.Random(seed).shuffle(prompts)
    return prompts if n is None else prompts[:n]


def _check_disjoint() -> None:
    """No built-in prompt is a held-out chat prompt, and no subject occurs in one (as whole words)."""
    from specdec.eval.prompts import CHAT

    overlap = set(CHAT) & set(builtin_prompts())
    if overlap:  # pragma: no cover - guards future edits
        raise RuntimeError(f"built-in training prompts overlap the held-out chat prompts: {sorted(overlap)}")
    for s in SUBJECTS:
        core = re.sub(r"^(the|a|an) ", "", s.lower())
        hits = [c for c in CHAT if re.search(rf"\b{re.escape(core)}\b", c.lower())]
        if hits:  # pragma: no cover - guards future edits
            raise RuntimeError(f"built-in subject {s!r} appears in held-out chat prompt(s) {hits}")


_check_disjoint()
