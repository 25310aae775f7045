"""The prompt set of `specmesh bench`: short code prompts cut from the demo corpus's held-out
files, plus a few English prose prompts. The set ships as ``bench_prompts.json`` next to this
module so every run (and every machine) uses the same prompts;
``python -m specmesh.bench_prompts [--out PATH]`` writes it again (``--help`` only prints
its help).

How the code prompts are made (deterministic for a given Python standard library):

1. Walk ``training.corpus.held_out_files()`` (the files the demo pair never trained on), sorted.
2. In each file take the first function or method, in source order, that has a docstring,
   at least one statement after it, a ``def`` line plus docstring of 2 to 12 lines and 60 to
   400 characters. The prompt is that ``def`` line through the end of the docstring, dedented,
   plus a newline and the body's indentation: the model writes the body.
3. Of the files that yield a prompt, keep ``CODE_PROMPTS`` spread evenly over the sorted list.
"""

from __future__ import annotations

import ast
import json
import platform
import textwrap
from pathlib import Path
from typing import Annotated

import typer

PROMPTS_PATH = Path(__file__).with_name("bench_prompts.json")
CODE_PROMPTS = 12
PROSE_PROMPTS = (  # written for the benchmark; the demo pair saw no English prose
    "The history of the printing press begins in the fifteenth century, when",
    "Dear members of the committee, thank you for reviewing our proposal. We would like to",
    "To make a good cup of tea, first warm the pot, then",
    "The main advantage of a distributed system over a single large computer is that",
)


def _prompt_from_function(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef
                          ) -> str | None:
    body = node.body
    if len(body) < 2 or not (isinstance(body[0], ast.Expr)
                             and isinstance(body[0].value, ast.Constant)
                             and isinstance(body[0].value.value, str)):
        return None
    first, last = node.lineno, body[0].end_lineno  # 1-based, inclusive
    if not 2 <= last - first + 1 <= 12:
        return None
    block = textwrap.dedent("\n".join(lines[first - 1:last]))
    indent = lines[body[1].lineno - 1][:body[1].col_offset]
    if body[1].lineno <= last or indent.strip(" \t"):  # body on the docstring's line
        return None
    base = lines[first - 1][:len(lines[first - 1]) - len(lines[first - 1].lstrip())]
    prompt = block + "\n" + indent[len(base):]
    return prompt if 60 <= len(prompt) <= 400 else None


def first_prompt(source: str) -> tuple[str, int] | None:
    """The first qualifying function of a file (see the module docstring): (prompt, line)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    lines = source.splitlines()
    funcs = sorted((n for n in ast.walk(tree)
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
                   key=lambda n: n.lineno)
    for node in funcs:
        prompt = _prompt_from_function(lines, node)
        if prompt is not None:
            return prompt, node.lineno
    return None


def make_prompt_set(n_code: int = CODE_PROMPTS) -> dict:
    """Builds the prompt set from the held-out files of the running Python's stdlib."""
    from training import corpus

    root = corpus.stdlib_root()
    found = []
    for path in corpus.held_out_files():
        hit = first_prompt(path.read_text(encoding="utf-8", errors="replace"))
        if hit is not None:
            found.append((path.relative_to(root).as_posix(), *hit))
    if len(found) > n_code:  # spread evenly over the files, first and last included
        found = [found[round(i * (len(found) - 1) / (n_code - 1))] for i in range(n_code)]
    prompts = [{"id": f"code-{i:02d}", "kind": "code", "source": f"{rel}:{line}",
                "prompt": prompt} for i, (rel, prompt, line) in enumerate(found)]
    prompts += [{"id": f"prose-{i:02d}", "kind": "prose", "source": "hand-written",
                 "prompt": text} for i, text in enumerate(PROSE_PROMPTS)]
    return {"made_by": "python -m specmesh.bench_prompts (see its docstring)",
            "python": platform.python_version(), "prompts": prompts}


def load_prompts(path: Path = PROMPTS_PATH, limit: int | None = None) -> list[dict]:
    """The shipped prompts (or those of ``path``): [{"id", "kind", "source", "prompt"}, ...].
    ``limit`` keeps the first ``limit`` of them, taking code and prose in turn."""
    prompts = json.loads(Path(path).read_text(encoding="utf-8"))["prompts"]
    if limit is None or limit >= len(prompts):
        return prompts
    code = [p for p in prompts if p["kind"] == "code"]
    prose = [p for p in prompts if p["kind"] != "code"]
    mixed = []
    while len(mixed) < limit:  # e.g. 3 of 16: two code prompts and one prose prompt
        for group in (code, code, prose):
            if group and len(mixed) < limit:
                mixed.append(group.pop(0))
    return mixed


def with_shared_prefix(prompts: list[dict], tokenizer, tokens: int,
                       source: list[dict] | None = None, contexts: int = 1,
                       unshared_every: int = 0) -> tuple[list[dict], int]:
    """The shared-prefix workload (``specmesh bench --shared-prefix N``): every prompt
    preceded by the same context of about ``tokens`` tokens, as chat traffic repeats a long
    system prompt or document before each short question. The context is the texts of the
    whole shipped set (``source``, default ``prompts``), in order and repeated as needed, cut
    at the last line break within ``tokens`` tokens of ``tokenizer``. With ``contexts`` > 1
    (``--shared-prefixes``), that many contexts, as several tenants' system prompts: context k
    starts at text k len / ``contexts`` of the set, and prompt i goes behind context i mod
    ``contexts``. With ``unshared_every`` K (``--unshared-every``), every Kth prompt (i mod K
    = K - 1) goes without a context, as traffic mixes requests behind a system prompt with
    requests that have none. Returns (the prompts, the shortest context's length in
    tokens)."""
    texts = [p["prompt"].rstrip() + "\n\n" for p in (source or prompts)]
    def count(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    made, lengths = [], []
    for k in range(contexts):
        context, t = "", k * len(texts) // contexts
        while len(count(context)) < tokens:
            context += texts[t % len(texts)]
            t += 1
        context = tokenizer.decode(count(context)[:tokens], skip_special_tokens=True)
        made.append(context[:context.rfind("\n") + 1] or context)
        lengths.append(len(count(made[-1])))
    def alone(i: int) -> bool:
        return bool(unshared_every) and i % unshared_every == unshared_every - 1

    shared = [dict(p) if alone(i) else
              {**p, "id": f"{p['id']}+prefix{'' if contexts == 1 else i % contexts}",
               "prompt": made[i % contexts] + p["prompt"]} for i, p in enumerate(prompts)]
    return shared, min(lengths)


def main(out: Annotated[Path, typer.Option(
        help="Where to write the set (default: the shipped bench_prompts.json).")] = PROMPTS_PATH,
         ) -> None:
    """Write the prompt set of `specmesh bench` again, from this Python's standard library
    (how the prompts are chosen: the docstring of specmesh/bench_prompts.py)."""
    out.write_text(json.dumps(make_prompt_set(), indent=2, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    typer.run(main)
