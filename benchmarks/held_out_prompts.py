"""Held-out prompts of the drafter grid (bench_drafters_cpu.py --grid): short tasks of kinds no drafter was tuned on.

Written for this project. They are used by the grid's "held-out" column only, never to tune, train or choose
a drafter, its options or the speculation policy: a drafter that is slower than plain decoding here is slower on
text it has not been fitted to. Short answers on purpose (classification, extraction, rewriting, tool-like
replies), the case where a drafter's fixed costs weigh most.
"""
from __future__ import annotations

HELD_OUT = (
    "Label the sentiment of this review as positive, negative or mixed: 'The battery lasts for days, but the "
    "screen scratches if you look at it.'",
    "Extract every date from this note and list them as YYYY-MM-DD: 'We met on 3 March 2021, signed on the 14th "
    "of June that year and closed the deal on 2 January 2022.'",
    "Rewrite in the passive voice: 'The committee approved the new parking rules after a long debate.'",
    "Turn this into a JSON object with the keys name, city and age: 'Priya, 34, lives in Leeds.'",
    "Is 221 a prime number? Answer yes or no, then give one line of reasoning.",
    "Write a one-sentence product description for a lamp that charges phones.",
    "Which of these is not a fruit: apple, carrot, plum, mango? Answer with one word.",
    "Reply as a support agent: a customer says their parcel arrived damaged. Two sentences.",
    "Give a regular expression that matches a UK postcode such as SW1A 1AA, and nothing else.",
    "Convert 72 degrees Fahrenheit to Celsius and show the formula you used.",
    "Suggest a git commit message for a change that fixes an off-by-one error in pagination.",
    "Name three board games that two people can play in under twenty minutes.",
)


def load_held_out(n: int) -> list[str]:
    if not 1 <= n:
        raise ValueError(f"n must be >= 1, got {n}")
    return list(HELD_OUT[:n])
