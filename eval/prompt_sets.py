"""Prompt categories written for specdec (question answering, math, translation) and the
retrieval-augmented category built from ``pydoc_data.topics``. Loaded through
:func:`specdec.eval.prompts.load_prompts`; users bring their own files (``specdec.eval.prompt_files``).
"""
from __future__ import annotations

QA = (
    "Who wrote the novel 'Pride and Prejudice'?",
    "What is the boiling point of water at sea level in Celsius?",
    "Which planet is known as the Red Planet, and why?",
    "What is the largest ocean on Earth?",
    "In which year did the first person walk on the Moon?",
    "What gas do plants absorb from the atmosphere?",
    "What is the chemical symbol for gold?",
    "How many bones are in the adult human body?",
    "What language has the most native speakers?",
    "Who painted the Mona Lisa?",
    "What is the speed of light in a vacuum, approximately?",
    "What is the smallest prime number?",
    "Which organ in the human body produces insulin?",
    "What is the tallest mountain in the world?",
    "What does DNA stand for?",
    "Which element has atomic number 1?",
    "What is the main ingredient of guacamole?",
    "How many continents are there, and what are they?",
    "What is the currency of the United Kingdom?",
    "Who developed the theory of general relativity?",
    "What is the longest river in Africa?",
    "What instrument measures atmospheric pressure?",
)

MATH = (
    "A train travels 180 km in 2 hours. What is its average speed? Solve step by step.",
    "If 3 notebooks cost 7.50 dollars, how much do 8 notebooks cost? Show your reasoning.",
    "Solve for x: 4x + 7 = 31. Explain each step.",
    "A rectangle is 12 cm long and 5 cm wide. What are its area and perimeter?",
    "What is 15% of 240? Show the calculation.",
    "Tom has twice as many apples as Sara. Together they have 27. How many does each have?",
    "A shirt costs 40 dollars and is discounted by 25%. What is the new price? Reason step by step.",
    "What is the sum of the integers from 1 to 50? Explain the method.",
    "A car uses 6 litres of fuel per 100 km. How much fuel does it need for 350 km?",
    "Find the average of 12, 15, 20, 22 and 31. Show your work.",
    "If a recipe for 4 people needs 300 g of flour, how much is needed for 10 people?",
    "Solve the system: x + y = 10 and x - y = 4. Explain.",
    "A bank account earns 5% simple interest per year. How much interest does 800 dollars earn in 3 years?",
    "What is the area of a circle with radius 7 cm? Use pi = 3.14 and show the steps.",
    "A worker is paid 18 dollars per hour and works 37.5 hours. What is the weekly pay?",
    "How many minutes are there in 3.5 days? Reason step by step.",
    "The ratio of boys to girls in a class is 3:4 and there are 28 students. How many are girls?",
    "Is 221 a prime number? Explain how you check.",
    "A tank holds 500 litres and fills at 20 litres per minute. How long does it take from empty?",
    "What is the least common multiple of 12 and 18? Show the steps.",
    "If the temperature drops from 12 degrees to -5 degrees, by how much did it fall?",
    "A triangle has angles of 35 and 65 degrees. What is the third angle and why?",
)

TRANSLATION = tuple(
    f"Translate into {lang}: \"{text}\""
    for lang, text in [
        ("French", "The library opens at nine o'clock every morning."),
        ("Spanish", "I would like a cup of coffee with milk, please."),
        ("German", "The weather is beautiful today, so we are going for a walk."),
        ("Italian", "My brother works as a doctor in a large hospital."),
        ("French", "Could you tell me where the train station is?"),
        ("Spanish", "We are planning a trip to the mountains next summer."),
        ("German", "Please close the window because it is cold."),
        ("Portuguese", "The children are playing football in the park."),
        ("French", "I have been learning to play the piano for two years."),
        ("Spanish", "The museum is closed on Mondays."),
        ("German", "She reads a book before going to sleep every night."),
        ("Italian", "This restaurant serves the best pizza in the city."),
        ("French", "Don't forget to buy bread on your way home."),
        ("Spanish", "How much does this jacket cost?"),
        ("German", "The meeting has been moved to Thursday afternoon."),
        ("Dutch", "We need more time to finish the project."),
        ("French", "The cat is sleeping on the sofa next to the fireplace."),
        ("Spanish", "My grandmother tells wonderful stories about her childhood."),
        ("German", "Can you recommend a good book about history?"),
        ("Italian", "The train to Rome leaves in ten minutes."),
        ("French", "Thank you very much for your help yesterday."),
        ("Spanish", "It is important to drink enough water every day."),
    ]
)


def retrieval_augmented(n: int, min_chars: int = 800, max_chars: int = 3000) -> list[str]:
    """A reference document from ``pydoc_data.topics`` plus a question answered from it."""
    from pydoc_data.topics import topics

    keys = sorted(k for k, v in topics.items() if min_chars <= len(v) <= max_chars)
    return [
        f"Answer the question using only the document below.\n\nDocument:\n{topics[k].strip()}\n\n"
        f"Question: According to the document, what is '{k}' and what is one rule it states?"
        for k in keys[:n]
    ]
