"""Write fine-tuning examples from the Python standard library: for each documented function, the
prompt is its signature and docstring, the response its body. ``archlab train --data OUT.jsonl``
trains on the bodies alone. With ``--chat``, each is a conversation instead: the user asks for the
body of the function, the assistant gives it.

    python docs/examples/stdlib_functions.py functions.jsonl --skip-chars 4000000

``--skip-chars`` leaves out the files that the first N characters of the ``stdlib`` corpus come
from (a run with ``data.max_bytes`` N read those), so a run pretrained there is fine-tuned on
functions it has not seen.
"""

from __future__ import annotations

import argparse
import ast
import json
import textwrap

from archlab.train.data import stdlib_files


def examples(source: str, longest: int) -> list[dict]:
    """A prompt/response pair for each function of ``source`` that has a docstring and a body
    after it of at most ``longest`` characters."""
    lines = source.splitlines(keepends=True)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        whole = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        head = len(textwrap.dedent("".join(lines[node.lineno - 1 : node.body[0].end_lineno])))
        prompt, response = whole[:head], whole[head:]
        if len(response) <= longest:
            found.append({"prompt": prompt, "response": response})
    return found


ASK = "Write the body of this function.\n"


def conversation(example: dict) -> dict:
    """A prompt/response example as a conversation: the user asks for the body, the assistant gives
    it. The request ends at its docstring's last character, as a message typed to ``archlab chat``
    does (its lines joined)."""
    return {"messages": [{"role": "user", "content": ASK + example["prompt"].rstrip("\n")},
                         {"role": "assistant", "content": example["response"]}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the .jsonl file to write")
    parser.add_argument("--skip-chars", type=int, default=0, help="leave out the files the corpus's first N characters come from")
    parser.add_argument("--longest", type=int, default=600, help="the longest body kept, in characters")
    parser.add_argument("--chat", action="store_true", help="write each as a conversation of a user and an assistant")
    args = parser.parse_args()
    read, written = 0, 0
    with open(args.out, "w", encoding="utf-8") as out:
        for file in stdlib_files():
            try:
                source = file.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # the corpus leaves such files out too
            before, read = read, read + len(source)
            if before < args.skip_chars:  # the corpus read some or all of it
                continue
            try:
                found = examples(source, args.longest)
            except SyntaxError:  # a file written for another Python's grammar
                continue
            for example in found:
                out.write(json.dumps(conversation(example) if args.chat else example) + "\n")
            written += len(found)
    print(f"{written:,} examples in {args.out}")


if __name__ == "__main__":
    main()
