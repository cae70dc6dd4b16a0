"""Chat-format training examples from the project corpus: a request built from a function's name, signature and
docstring, answered with the function's source.

    from chat_data import chat_examples         # with tools/ on sys.path
    examples = chat_examples(documents(load_split("train")), template, encode, seed=0)

Each example is (prompt ids, completion ids). The prompt is the chat template's rendering with the generation
prompt, tokenized as `LLM.prompt_ids` tokenizes it, so training sees exactly the ids that inference feeds:
- thinking on (the template's default), the prompt ends in `<think>\\n` and the completion is
  `\\n</think>\\n\\n` + answer + `<|im_end|>` (an empty reasoning block, then the answer);
- thinking off, the prompt ends in `<think>\\n\\n</think>\\n\\n` and the completion is answer + `<|im_end|>`.
A quarter of the examples carry an earlier turn (which the template renders without a reasoning block), a
third a system message. Standard library only (plus the caller's template and encoder).
"""

from __future__ import annotations

import ast
import random
import textwrap
from collections.abc import Callable, Sequence

MAX_SOURCE_CHARS = 1200  # about 400 tokens: a prompt and its answer fit a 512-token training window
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You write Python.", "Answer with code only.")
REQUESTS = (
    "Write a function to {summary}",
    "Write a Python function `{name}{signature}`: {summary}",
    "Implement `{name}`. {docstring}",
    "Can you write {name}{signature}? It should {summary}",
    "Write a function named {name} to {summary}",
)


def functions(document: str) -> list[tuple[str, str, str, str]]:
    """(name, signature, docstring, source) of the functions and methods in one corpus document that have a
    docstring and at most MAX_SOURCE_CHARS of source; [] when the document does not parse."""
    text = document.split("\n", 1)[1] if document.startswith("# file:") else document
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        docstring = ast.get_docstring(node)
        source = "".join(lines[node.lineno - 1 : node.end_lineno])  # whole lines, decorators left out
        if not docstring or len(source) > MAX_SOURCE_CHARS or node.name.startswith("__"):
            continue
        signature = "(" + ast.unparse(node.args) + ")"
        found.append((node.name, signature, docstring.strip(), textwrap.dedent(source).rstrip()))
    return found


def request(name: str, signature: str, docstring: str, rng: random.Random) -> str:
    """A user request for the function, from one of REQUESTS."""
    first = docstring.split("\n\n", 1)[0].replace("\n", " ").strip()
    summary = first[:1].lower() + first[1:]
    if not summary.endswith("."):
        summary += "."
    return rng.choice(REQUESTS).format(name=name, signature=signature, summary=summary, docstring=first)


def answer(source: str) -> str:
    return f"```python\n{source}\n```"


def chat_examples(documents: Sequence[str], template, encode: Callable[[str], list[int]], *, seed: int,
                  limit: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Chat examples for every documented function of `documents` (at most `limit`), in a seeded order.

    `template`: a ninfer ChatTemplate; `encode`: text -> ids with special tokens recognised (Tokenizer.encode).
    """
    rng = random.Random(seed)
    pool = [f for document in documents for f in functions(document)]
    rng.shuffle(pool)
    pool = pool[:limit] if limit is not None else pool
    examples = []
    for index, (name, signature, docstring, source) in enumerate(pool):
        messages = []
        if rng.random() < 1 / 3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        if index and rng.random() < 1 / 4:
            earlier = pool[rng.randrange(index)]
            messages += [{"role": "user", "content": request(*earlier[:3], rng)},
                         {"role": "assistant", "content": answer(earlier[3])}]
        messages.append({"role": "user", "content": request(name, signature, docstring, rng)})
        thinking = rng.random() < 0.5
        prompt = template.render(messages, add_generation_prompt=True, enable_thinking=thinking)
        completion = ("\n</think>\n\n" if thinking else "") + answer(source) + "<|im_end|>"
        examples.append((encode(prompt), encode(completion)))
    return examples


def pack(examples: Sequence[tuple[list[int], list[int]]], length: int,
         rng: random.Random) -> tuple[list[int], list[bool]]:
    """One training window of `length` ids: randomly drawn examples back to back (the last one cut), with a mask
    that is True on completion ids (the ids a loss is taken on). Examples longer than the window are cut too."""
    ids: list[int] = []
    mask: list[bool] = []
    while len(ids) < length:
        prompt, completion = examples[rng.randrange(len(examples))]
        ids += prompt + completion
        mask += [False] * len(prompt) + [True] * len(completion)
    return ids[:length], mask[:length]
