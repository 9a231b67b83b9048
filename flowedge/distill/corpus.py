"""What a draft head learns from: text already on the machine, and instructions for the base model to answer.

- Teacher-forced text: the `.py` and `.md` files that installed packages carry (this interpreter's
  site-packages), sampled with a fixed seed, a slice of each file. Packages that ship benchmark data
  (flowedge/datasets.py's sources) are skipped, so no evaluation prompt is ever trained on.
- Instructions: varied requests written for this purpose (code in several languages, explanations,
  writing, data wrangling); the base model answers them itself at temperature 0, so the head learns the
  base's own continuations in the chat format it serves. None is a benchmark prompt.
"""
from __future__ import annotations

import logging
import random
import site
import sysconfig
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

SUFFIXES = (".py", ".md")
MIN_CHARS = 400
SLICE_CHARS = 6000

INSTRUCTIONS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain what a Python generator is and show a short example.",
    "Write a C function that reverses a singly linked list in place.",
    "How do I read a CSV file with pandas and keep only the rows where the 'price' column is above 100?",
    "Write a bash script that prints the ten largest files under the current directory.",
    "Describe the difference between a process and a thread in a few paragraphs.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
    "Write a Rust function that counts the words in a string and returns a HashMap.",
    "Give me a short checklist for reviewing a pull request.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods, with tests using pytest.",
    "Explain big-O notation to a beginner, with examples of O(1), O(n) and O(n log n).",
    "Write a Go program that starts an HTTP server answering 'hello' on /hello.",
    "Write a regular expression that matches ISO 8601 dates like 2024-03-15 and explain each part.",
    "Write a Python script that renames every .jpeg file in a folder to .jpg.",
    "What are the main differences between TCP and UDP?",
    "Write a short story opening of about 150 words set on a night train.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain how a hash map handles collisions.",
    "Write a TypeScript interface for a blog post and a function that sorts posts by date.",
    "Write a Dockerfile for a small Flask application.",
    "Summarise the pros and cons of microservices compared to a monolith.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a polite email asking a colleague to review a design document by Friday.",
    "Implement binary search in Java and explain its loop invariant.",
    "Write a Python decorator that retries a function up to three times on exceptions.",
    "Explain what a closure is in JavaScript with an example.",
    "Write a Makefile with build, test and clean targets for a C project.",
    "How can I profile a slow Python program? List the tools and how to use them.",
    "Write a Python function that parses a query string like 'a=1&b=2' into a dictionary.",
    "Explain the CAP theorem in simple terms.",
    "Write a unit test in Python for a function add(a, b) using unittest.",
    "Write a shell one-liner that counts the lines of all .py files in a project.",
    "Describe how garbage collection works in Python.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a C++ class for a 2D vector with addition and dot product.",
    "Give three tips for writing clear commit messages, with examples.",
    "Write a Python asyncio program that fetches three URLs concurrently (use a stub fetch function).",
    "Explain the difference between git merge and git rebase.",
    "Write a function in Python that converts a Roman numeral to an integer.",
    "Write a haiku about debugging.",
    "Write a Python script that reads a JSON file and prints its keys sorted.",
    "What is dependency injection and why is it useful?",
    "Write a Kotlin data class for a user and a function that filters adult users.",
    "Explain what a race condition is and how a lock prevents it.",
    "Write a Python function that computes the moving average of a list with a window size k.",
    "Write a YAML GitHub Actions workflow that runs pytest on every push.",
    "Describe the steps of the TLS handshake at a high level.",
)


def site_packages() -> list[Path]:
    """This interpreter's site-packages folders (where installed packages keep their code and docs)."""
    roots = {Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["platlib"])}
    roots.update(Path(p) for p in site.getsitepackages())
    return sorted(p for p in roots if p.is_dir())


def excluded_packages() -> set[str]:
    """Top-level folders of the packages that carry benchmark data (never read)."""
    from flowedge.datasets import SOURCES

    return {s.member.split("/", 1)[0] for s in SOURCES.values()}


def source_files(roots: list[Path], seed: int) -> list[Path]:
    """Every .py / .md file under `roots` outside excluded packages, in a seeded random order."""
    skip = excluded_packages()
    files = []
    for root in roots:
        for path in root.rglob("*"):
            rel = path.relative_to(root).parts
            if path.suffix in SUFFIXES and rel and rel[0] not in skip and path.is_file():
                files.append(path)
    files.sort()
    random.Random(seed).shuffle(files)
    return files


def text_slices(roots: list[Path], seed: int) -> Iterator[str]:
    """A slice of up to SLICE_CHARS from each file in turn (from a seeded offset), skipping short ones."""
    rng = random.Random(seed + 1)
    for path in source_files(roots, seed):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < MIN_CHARS:
            continue
        start = rng.randrange(0, max(1, len(text) - SLICE_CHARS)) if len(text) > SLICE_CHARS else 0
        start = text.rfind("\n", 0, start) + 1 if start else 0
        yield text[start:start + SLICE_CHARS]


def token_chunks(tokenizer, roots: list[Path], seed: int, length: int) -> Iterator[list[int]]:
    """Token sequences of exactly `length` from the text slices (a slice's tail joins the next one's head)."""
    pending: list[int] = []
    for text in text_slices(roots, seed):
        pending += tokenizer(text)["input_ids"]
        while len(pending) >= length:
            yield pending[:length]
            pending = pending[length:]
