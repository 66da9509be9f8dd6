"""Prompt sources for training data: a built-in generator and user files.

The built-in source is programmatic: instruction templates crossed with topics (coding tasks in a
dozen languages, programming concepts, general-knowledge topics, arithmetic word problems), a few
thousand distinct prompts in a fixed, seeded order. It deliberately contains no benchmark set:
HumanEval, MBPP, GSM8K, MT-Bench and the like stay held out for measuring acceptance.

(No offline instruction dataset on PyPI was both small and clearly licensed: the ShareGPT package is
hundreds of MB of scraped conversations, and AlpacaEval is an evaluation set. Hence the generator.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from dflash.core.errors import InputError

LANGUAGES = (
    "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "C#", "Ruby", "Kotlin", "Bash",
)

CODING_TASKS = (
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a sentence",
    "merges two sorted lists into one sorted list",
    "removes duplicates from a list while keeping the original order",
    "computes the factorial of n",
    "finds the maximum value in an array without using a built-in max",
    "converts a temperature from Celsius to Fahrenheit",
    "parses a date string in YYYY-MM-DD format into year, month and day",
    "flattens a nested list",
    "computes the greatest common divisor of two integers",
    "checks whether a string is a palindrome, ignoring case and spaces",
    "counts the vowels in a string",
    "returns the n-th Fibonacci number iteratively",
    "validates that a string looks like an email address",
    "groups a list of words by their first letter",
    "computes the average of a list of numbers",
    "finds the second largest number in a list",
    "rotates an array to the right by k positions",
    "computes the running sum of a list of numbers",
    "converts a binary string to an integer",
    "capitalizes the first letter of every word in a sentence",
    "splits a line of comma-separated values into fields",
    "performs binary search on a sorted array",
    "sorts a list of records by one of their fields",
    "finds the elements that two lists have in common",
    "transposes a matrix",
    "computes the dot product of two vectors",
    "checks whether the brackets in a string are balanced",
    "counts how often each character occurs in a string",
    "generates all subsets of a small set",
    "raises a number to an integer power by repeated squaring",
    "formats an integer with thousands separators",
    "splits a list into chunks of size k",
    "finds the longest word in a sentence",
    "computes the median of a list of numbers",
    "checks whether two strings are anagrams",
    "implements a stack with push, pop and peek",
    "implements a queue using two stacks",
    "computes the sum of the digits of an integer",
    "converts a Roman numeral to an integer",
    "converts an integer to a Roman numeral",
    "returns the first element that appears twice in a list",
    "merges two dictionaries, summing the values of shared keys",
    "computes the edit distance between two strings",
    "generates the first n prime numbers",
    "returns the unique values of a list in sorted order",
    "truncates a string to n characters and adds an ellipsis",
    "computes compound interest for a given rate and number of years",
    "checks whether a year is a leap year",
    "counts the lines, words and characters of a text file",
    "converts a string from snake_case to camelCase",
)

CODING_TEMPLATES = (
    "Write a {lang} function that {task}.",
    "In {lang}, implement a function that {task}. Include a short usage example.",
    "Show me {lang} code that {task}, and explain how it works.",
    "Write a {lang} function that {task}. Add comments to the code.",
    "How would you write a function in {lang} that {task}?",
    "Write unit tests in {lang} for a function that {task}.",
    "What is an efficient way to write a {lang} function that {task}? Give the code.",
)

CONCEPTS = (
    "recursion", "a hash table", "a linked list", "Big-O notation", "a closure", "garbage collection",
    "a race condition", "a REST API", "a database index", "version control with git", "unit testing",
    "dependency injection", "immutability", "a binary search tree", "dynamic programming", "a mutex",
    "an iterator", "exception handling", "type inference", "a virtual machine", "memoization",
    "regular expressions", "a compiler", "process scheduling in an operating system", "caching",
    "pagination in an API", "the JSON format", "the difference between TCP and UDP", "a deadlock",
    "polymorphism", "a message queue", "floating-point rounding errors",
)

CONCEPT_TEMPLATES = (
    "Explain {concept} to a beginner programmer.",
    "What is {concept}? Give a short example.",
    "What are the advantages and disadvantages of {concept}?",
    "Describe {concept} in three sentences.",
    "When should a programmer think about {concept}?",
)

TOPICS = (
    "the water cycle", "photosynthesis", "the French Revolution", "how vaccines work", "climate change",
    "the printing press", "black holes", "healthy sleep habits", "learning a new language", "saving money",
    "time management", "the Roman Empire", "volcanoes", "the human heart", "renewable energy",
    "the early internet", "coffee", "the Olympic Games", "honeybees", "ocean tides", "electric cars",
    "meditation", "the Moon landing", "chess", "rainforests", "the stock market", "recycling",
    "earthquakes", "the immune system", "public speaking", "gardening", "the Great Wall of China",
    "machine learning", "inflation", "bird migration", "the periodic table", "jazz music",
    "ancient Egypt", "training for a marathon", "baking bread", "the solar system", "DNA", "democracy",
    "teamwork", "writing a resume", "job interviews", "hiking safety", "the Renaissance",
    "weather forecasting", "nutrition", "electricity", "plate tectonics", "the Industrial Revolution",
    "bicycles", "public libraries", "friendship", "volunteering", "photography", "mountains", "deserts",
)

TOPIC_TEMPLATES = (
    "Write a short paragraph about {topic}.",
    "Explain {topic} in simple terms.",
    "Give me three interesting facts about {topic}.",
    "Write a short poem about {topic}.",
    "Summarize the key ideas of {topic} in a few bullet points.",
    "What are common misconceptions about {topic}?",
    "Write a short story for children that involves {topic}.",
    "Give five practical tips related to {topic}.",
    "Write the opening paragraph of a blog post about {topic}.",
    "Create a quiz with three questions and answers about {topic}.",
)

# Broader general chat: everyday subjects crossed with the kinds of request people make of an assistant.
SUBJECTS = (
    "home workouts", "cooking rice", "a first job", "moving to a new city", "studying for exams", "budgeting",
    "composting", "raising a puppy", "caring for houseplants", "learning to swim", "writing a cover letter",
    "negotiating a salary", "a road trip", "camping", "first aid", "stress", "procrastination", "habits",
    "a wedding toast", "a birthday party", "remote work", "online privacy", "strong passwords", "phishing emails",
    "buying a used car", "renting an apartment", "a job offer", "a difficult conversation with a friend",
    "learning the guitar", "drawing", "reading more books", "a book club", "a podcast", "starting a blog",
    "a small business", "customer service", "a team meeting", "giving feedback", "leadership", "mentoring",
    "climate adaptation", "water conservation", "air pollution", "wildfires", "hurricanes", "snow storms",
    "the history of tea", "the history of chocolate", "the Silk Road", "the Vikings", "ancient Greece",
    "the Aztecs", "the Cold War", "the space race", "the invention of the telephone", "the steam engine",
    "antibiotics", "the common cold", "allergies", "hydration", "posture", "eye strain", "screen time for kids",
    "sharks", "elephants", "octopuses", "penguins", "wolves", "coral reefs", "the Amazon river", "the Sahara",
    "glaciers", "the northern lights", "rainbows", "thunderstorms", "gravity", "magnets", "sound waves",
    "light and color", "atoms", "nuclear energy", "solar panels", "wind turbines", "batteries", "3D printing",
    "smartphones", "social media", "video games", "streaming services", "artificial intelligence", "robots",
    "self-driving cars", "drones", "cryptocurrency", "credit scores", "retirement savings", "insurance",
    "taxes", "mortgages", "volunteering abroad", "learning to cook", "meal planning", "vegetarian diets",
    "running shoes", "yoga", "cycling to work", "public transport", "city parks", "museums", "theater",
    "classical music", "painting with watercolors", "knitting", "birdwatching", "astronomy as a hobby",
    "chess openings", "board games", "puzzles", "magic tricks", "origami", "photography at night",
    "time zones", "calendars", "maps", "compasses", "the metric system", "money and banks", "trade",
    "supply and demand", "unemployment", "elections", "the United Nations", "human rights", "free speech",
    "ethics of AI", "kindness", "gratitude", "grief", "loneliness", "confidence", "motivation", "curiosity",
)

REQUEST_TEMPLATES = (
    "Can you explain {subject} to me like I am ten years old?",
    "I want to learn about {subject}. Where should I start?",
    "What should everyone know about {subject}?",
    "Give me a step-by-step guide to {subject}.",
    "What are the pros and cons of {subject}?",
    "Tell me a fun fact about {subject}.",
    "Write a haiku about {subject}.",
    "Write a limerick about {subject}.",
    "Write a friendly email to a colleague about {subject}.",
    "Write a short speech about {subject}.",
    "What mistakes do people often make with {subject}?",
    "Explain the history of {subject} briefly.",
    "How has {subject} changed over the last fifty years?",
    "Write a dialogue between two friends discussing {subject}.",
    "List five questions a curious student might ask about {subject}, with answers.",
    "Describe {subject} in one paragraph for a newspaper.",
    "What is the most important thing to understand about {subject}?",
    "How do I explain {subject} to my grandparents?",
    "Give me a checklist for {subject}.",
    "Write a tweet about {subject}.",
    "Compare {subject} with {other}.",
    "What do {subject} and {other} have in common?",
)

ITEMS = ("apples", "notebooks", "pencils", "tickets", "oranges", "books", "cups of coffee", "plants")
NUM_WORD_PROBLEMS = 400


def builtin_prompts(limit: int | None = None, *, seed: int = 0) -> list[str]:
    """Distinct built-in prompts in a seeded random order (all of them when `limit` is None)."""
    prompts = [t.format(lang=lang, task=task) for t in CODING_TEMPLATES for lang in LANGUAGES for task in CODING_TASKS]
    prompts += [t.format(concept=c) for t in CONCEPT_TEMPLATES for c in CONCEPTS]
    prompts += [t.format(topic=topic) for t in TOPIC_TEMPLATES for topic in TOPICS]
    prompts += _word_problems(random.Random(seed + 1), NUM_WORD_PROBLEMS)
    prompts += general_prompts(seed=seed)
    prompts = list(dict.fromkeys(prompts))  # distinct, first occurrence kept
    random.Random(seed).shuffle(prompts)
    return prompts if limit is None else prompts[:limit]


def general_prompts(*, seed: int = 0) -> list[str]:
    """Everyday requests (explain, advise, list, write, compare) about many subjects, in a seeded order."""
    rng = random.Random(seed + 2)
    subjects = list(SUBJECTS) + list(TOPICS)
    prompts = []
    for template in REQUEST_TEMPLATES:
        for subject in subjects:
            other = rng.choice([s for s in subjects if s != subject]) if "{other}" in template else ""
            prompts.append(template.format(subject=subject, other=other))
    return prompts


def _word_problems(rng: random.Random, count: int) -> list[str]:
    """Arithmetic word problems with random numbers: the target's answers are step-by-step text."""
    makers = (
        lambda: f"A shop sells {rng.choice(ITEMS)} for {rng.randint(2, 40)} dollars each. How much do "
        f"{rng.randint(3, 60)} of them cost? Explain your reasoning.",
        lambda: f"A train travels at {rng.randint(40, 300)} km/h for {rng.randint(2, 9)} hours. How far does it go?",
        lambda: f"What is {rng.randint(12, 999)} multiplied by {rng.randint(12, 99)}? Show the steps.",
        lambda: f"Solve for x: {rng.randint(2, 12)}x + {rng.randint(1, 50)} = {rng.randint(60, 200)}.",
        lambda: f"A recipe needs {rng.randint(2, 9)} eggs for {rng.randint(2, 6)} people. How many eggs are "
        f"needed for {rng.randint(7, 30)} people?",
        lambda: f"What is {rng.randint(5, 95)} percent of {rng.randint(20, 2000)}?",
    )
    problems: list[str] = []
    seen: set[str] = set()
    while len(problems) < count:
        text = rng.choice(makers)()
        if text not in seen:
            seen.add(text)
            problems.append(text)
    return problems


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: JSONL with a "prompt" (or "instruction") string per line, else one prompt per line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no prompts file {path}", hint="pass a .jsonl file with a \"prompt\" field, or a text file")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise InputError(f"{path} holds no prompts", hint="one prompt per line, or JSONL with a \"prompt\" field")
    if path.suffix != ".jsonl":
        return [line.strip() for line in lines]
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{path}:{number} is not JSON: {exc}", hint="one JSON object per line") from exc
        text = record.get("prompt") or record.get("instruction") if isinstance(record, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{path}:{number} has no \"prompt\" string", hint='e.g. {"prompt": "Write a haiku."}')
        prompts.append(text)
    return prompts


_STDLIB_FRAMES = (
    "Complete the following Python function.\n\n```python\n{code}```",
    "Write the body of this function so that it does what its docstring says:\n\n```python\n{code}```",
    "{code}",
    "{code}",
)


def library_prompts(
    roots, limit: int | None = None, *, seed: int = 0, max_files: int | None = None, skip: tuple[str, ...] = ()
) -> list[str]:
    """Function stubs (signature + docstring, no body) from the Python files under `roots`.

    Tests and vendored copies are skipped; each distinct stub is framed once, at random, as "complete
    this function", "write the body" or the bare stub (as HumanEval-style prompts come).
    """
    import ast

    paths = []
    for root in roots:
        root = Path(root)
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).parts
            if any(part in {"test", "tests", "testing", "idlelib", "lib2to3", "_vendor", "vendored", *skip}
                   or part.startswith("test_") for part in parts):
                continue
            paths.append(path)
    if max_files is not None and len(paths) > max_files:  # a seeded sample of every package, not the first ones
        paths = sorted(random.Random(seed).sample(paths, max_files))
    stubs = []
    for path in paths:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError, RecursionError, MemoryError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                stub = _stub(node)
                if stub:
                    stubs.append(stub)
    rng = random.Random(seed)
    rng.shuffle(stubs)
    prompts = [rng.choice(_STDLIB_FRAMES).format(code=stub) for stub in dict.fromkeys(stubs)]
    return prompts[:limit] if limit is not None else prompts


def _stub(node) -> str | None:
    import ast

    doc = ast.get_docstring(node, clean=True)
    if not doc or len(doc) < 40 or len(doc) > 1200:
        return None
    args = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    body = "\n".join(f"    {line}" if line else "" for line in doc.splitlines())
    return f'{keyword} {node.name}({args}){returns}:\n    """{body.strip()}\n    """\n'


# Lead-ins of a self-instructed user turn: the target writes the rest of the request. Everyday requests of
# every kind (the chat the default pair is benchmarked on is general chat, not code).
LEAD_INS = (
    "", "", "", "", "How", "How do I", "How can I", "What", "What is", "What are", "Why", "Why do", "Explain",
    "Can you explain", "Can you help me", "Could you", "Write", "Write a short", "Give me", "Suggest", "Describe",
    "Tell me", "I need", "I want to", "I have", "I'm", "My", "Is it", "Should I", "Compare", "List", "Summarize",
    "Help me", "Please", "Which", "When", "Where", "Who", "What's the best way to", "Do you know", "Create",
    "Plan", "Recommend", "Translate", "Rewrite", "Is there", "What should I", "What happens when", "Teach me",
)


def chat_user_prefix(tokenizer) -> str:
    """The rendered chat template up to where a user's message begins (system prompt included)."""
    marker = "\u2063USER\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return text[: text.index(marker)]


def self_instruct_prompts(
    target, count: int, *, batch_size: int = 1024, max_query_tokens: int = 64, temperature: float = 1.0,
    top_k: int = 64, seed: int = 0, lead_ins: tuple[str, ...] = LEAD_INS, time_limit_s: float | None = None,
) -> list[str]:
    """Up to `count` distinct user requests written by the target itself (Magpie, Xu et al. 2024).

    The target continues its own chat template at the start of a user turn (after a random lead-in, so
    requests of many kinds come out), sampled, until its end-of-turn token: requests in the style the
    model expects, as many and as varied as asked for, with no dataset. Requests cut by
    `max_query_tokens`, shorter than three words, or holding template tokens are dropped; duplicates
    (case and spacing folded) are kept once. Decontaminate them as any prompt (the caller does).
    """
    import time

    import torch

    from .data import pad_token_id, stop_token_ids
    from .fastgen import static_generate

    tokenizer = target.tokenizer
    prefix = chat_user_prefix(tokenizer)
    stops = sorted(stop_token_ids(target))
    rng = random.Random(seed)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    seen: set[str] = set()
    prompts: list[str] = []
    start = time.monotonic()
    attempts = 0
    while len(prompts) < count and attempts < 8 * max(1, count // batch_size + 1):
        if time_limit_s is not None and attempts and time.monotonic() - start > time_limit_s:
            break
        attempts += 1
        leads = [rng.choice(lead_ins) for _ in range(batch_size)]
        ids = [tokenizer(prefix + lead, add_special_tokens=False)["input_ids"] for lead in leads]
        answers = static_generate(target.model, ids, max_query_tokens, pad_id=pad_token_id(target), stop_ids=stops,
                                  temperature=temperature, top_k=top_k, generator=generator)
        for lead, (tokens, finished) in zip(leads, answers):
            if not finished:
                continue
            body = tokenizer.decode([t for t in tokens if t not in stops], skip_special_tokens=False)
            text = " ".join((lead + body).split())  # the body continues the lead-in's text as tokenized
            if len(text.split()) < 3 or "<|" in text or "|>" in text:
                continue
            key = text.lower()
            if key not in seen:
                seen.add(key)
                prompts.append(text)
                if len(prompts) == count:
                    break
    return prompts
