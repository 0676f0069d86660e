"""The prompt set self-distillation asks the target: built in, from material every install has.

Two sources, both deterministic for a seed and a Python version, neither downloaded:

* instruction templates over a list of topics (explain, compare, list, write a story or an email,
  plan, argue both sides ...), so the head sees the open-ended chat it will draft for;
* functions from the Python standard library's own sources, with code tasks around them (explain,
  document, review, test, rewrite), so it also sees code.

Topics and templates are split once into a training part and a held-out part (``split="heldout"``):
benchmarks measure a trained head on held-out prompts, which share no topic and no template with the
training prompts. ``--prompts FILE`` replaces the built-in set (one prompt per line, or a JSON list of
strings, or JSON lines with a "prompt" field).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from spekula.core.errors import ConfigError

TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "machine learning",
    "the water cycle", "volcanoes", "the immune system", "climate change", "the Roman Empire",
    "quantum computing", "honeybees", "the stock market", "plate tectonics", "vaccines",
    "the Internet", "renewable energy", "the human brain", "inflation", "the Moon landing",
    "coral reefs", "electric cars", "the printing press", "sleep", "democracy", "coffee",
    "the Silk Road", "recycling", "earthquakes", "DNA", "the Renaissance", "blockchains",
    "meditation", "rainforests", "the theory of relativity", "jazz music", "supply and demand",
    "public libraries", "the Olympic Games", "antibiotics", "solar panels", "chess",
    "the ancient Egyptians", "cloud computing", "migration of birds", "nutrition", "glaciers",
    "the Industrial Revolution", "social media", "volunteering", "the periodic table",
    "urban gardening", "time management", "the ocean tides", "public speaking", "bread baking",
    "cryptography", "the human heart", "wind turbines", "the Great Wall of China", "friendship",
    "learning a language", "the solar system", "remote work", "mushrooms", "traffic congestion",
    "the history of mathematics", "space telescopes", "wolves", "budgeting", "the Amazon river",
    "open-source software", "pollination", "hurricanes", "the Cold War", "composting",
    "artificial sweeteners", "lighthouses", "the Vikings", "3D printing", "rainbows", "penguins",
    "the metric system", "sourdough", "kindness", "the Byzantine Empire", "nuclear fusion",
    "bicycles", "the history of writing", "deserts", "elections", "origami", "robots",
    "tea ceremonies", "the speed of light", "hiking safety", "dinosaurs", "insurance",
    "the Hubble constant", "fermentation", "minimalism", "the printing of money", "caves",
    "online privacy", "marathon training", "the Mongol Empire", "electricity", "typography",
    "the placebo effect", "satellites", "rivers", "jellyfish", "the scientific method",
    "video games", "cathedrals", "fire safety", "memory", "the Pacific Ocean", "gardening",
    "telescopes", "cheese making", "the history of medicine", "salt", "trains", "habits",
)

TEMPLATES = (
    "Explain {t} to a ten-year-old.",
    "Write a short essay about {t}.",
    "What are the most important facts about {t}?",
    "Give me three surprising facts about {t}.",
    "Write a short story in which {t} plays a central role.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few paragraphs.",
    "How would you teach a beginner about {t}? Give a step-by-step plan.",
    "Write a poem about {t}.",
    "What are common misconceptions about {t}?",
    "Compare {t} with something people know from everyday life.",
    "Write an email to a friend telling them what you learned about {t}.",
    "List five questions a student might ask about {t}, and answer them.",
    "Why does {t} matter today?",
    "Describe {t} as if you were writing an encyclopedia entry.",
    "Give a balanced argument for and against investing more public money in {t}.",
    "Write a dialogue between a teacher and a student about {t}.",
    "What would the world look like without {t}?",
    "Write a blog post introduction about {t}.",
    "Explain the key ideas behind {t} in simple terms.",
    "Create a short quiz about {t} with answers.",
    "What careers are related to {t}, and what do they involve?",
    "Tell me something interesting about {t} and why it is interesting.",
    "Write a product description for a book about {t}.",
)

CODE_TASKS = (
    "Explain what this Python function does:\n\n```python\n{c}\n```",
    "Add a clear docstring to this Python function:\n\n```python\n{c}\n```",
    "Review this Python code and suggest improvements:\n\n```python\n{c}\n```",
    "Write a unit test for this Python function:\n\n```python\n{c}\n```",
    "Rewrite this Python function to be easier to read:\n\n```python\n{c}\n```",
    "What could go wrong when calling this function?\n\n```python\n{c}\n```",
)

# Every HELD_OUT_EVERY-th topic, template and code task belongs to the held-out split only.
HELD_OUT_EVERY = 5
SPLITS = ("train", "heldout")


def _part(items: tuple[str, ...], split: str) -> list[str]:
    held = split == "heldout"
    return [x for i, x in enumerate(items) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == held]


def stdlib_functions(limit: int, seed: int, *, min_lines: int = 6, max_lines: int = 30) -> list[str]:
    """Source of up to ``limit`` top-level functions from the standard library, chosen by ``seed``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "site-packages", "dist-packages", "idlelib", "turtledemo", "lib2to3", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py")
                   if not p.name.startswith("_") and not skip.intersection(p.relative_to(root).parts))
    rng = random.Random(seed)
    rng.shuffle(files)
    found: list[str] = []
    per_module = 4  # a few per module keeps the set varied
    for path in files:
        if len(found) >= limit:
            break
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        taken = 0
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.end_lineno is not None and taken < per_module:
                n = node.end_lineno - node.lineno + 1
                if min_lines <= n <= max_lines:
                    found.append("\n".join(lines[node.lineno - 1:node.end_lineno]))
                    taken += 1
    return found[:limit]


def builtin_prompts(n: int, *, seed: int = 0, split: str = "train", code_fraction: float = 0.2) -> list[str]:
    """``n`` distinct prompts of the given split: chat templates over topics, and stdlib code tasks."""
    if split not in SPLITS:
        raise ConfigError(f"unknown prompt split {split!r}; choose one of {', '.join(SPLITS)}")
    rng = random.Random(f"spekula-prompts/{seed}/{split}")
    chat = [tpl.format(t=t) for tpl in _part(TEMPLATES, split) for t in _part(TOPICS, split)]
    rng.shuffle(chat)
    n_code = int(round(n * code_fraction))
    tasks = _part(CODE_TASKS, split)
    # Held-out code tasks are built on other functions than training ones: alternate picks from one list
    # (a module may give functions to both sides; no function is in both).
    funcs = stdlib_functions(2 * n_code + 2, seed)
    funcs = funcs[1::2] if split == "heldout" else funcs[0::2]
    code = [tasks[i % len(tasks)].format(c=f) for i, f in enumerate(funcs[:n_code])]
    prompts = code + chat[: n - len(code)]
    rng.shuffle(prompts)
    if len(prompts) < n:
        raise ConfigError(f"the built-in prompt set has {len(prompts)} {split} prompts, fewer than the {n} asked "
                          f"for; pass --prompts FILE with more")
    return prompts


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings, JSON lines with "prompt", or one prompt per line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read prompts from {p}: {exc}") from None
    stripped = text.strip()
    prompts: list[str] = []
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{p}: not a JSON list of strings: {exc}") from None
        if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
            raise ConfigError(f"{p}: a JSON prompt file must be a list of strings")
        prompts = data
    elif stripped.startswith("{"):
        for i, line in enumerate(stripped.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{p}:{i}: not a JSON object: {exc}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ConfigError(f"{p}:{i}: each JSON line needs a string field \"prompt\"")
            prompts.append(obj["prompt"])
    else:
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    prompts = [x for x in prompts if x.strip()]
    if not prompts:
        raise ConfigError(f"{p}: no prompts")
    return prompts


def prompt_digest(prompts: list[str]) -> str:
    """A short digest naming a prompt list (part of the feature cache's key)."""
    h = hashlib.sha256()
    for x in prompts:
        h.update(x.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def iter_prompt_files(paths: list[str]) -> Iterator[str]:
    for path in paths:
        yield from read_prompt_file(path)
