#!/usr/bin/env python3
"""Every C++ block shown in README.md and docs/*.md is code the build compiles.

Each ```cpp block must occur, line for line, in one source file under examples/, tests/, bench/
or tools/ (leading indentation and trailing spaces ignored, a block's lines consecutive in the
file, blank lines included). A block that is not compiled anywhere drifts from the API unseen.
Usage: tests/check_snippets.py <repository root> (ctest runs it as docs_snippets); exit status 1 lists every block that matches no file.
"""
import pathlib
import sys


def normalise(lines):
    return [line.strip() for line in lines]


def blocks(markdown):
    out, inside, start, current = [], False, 0, []
    for number, line in enumerate(markdown.read_text(encoding="utf-8").split("\n"), 1):
        stripped = line.strip()
        if not inside and stripped in ("```cpp", "```c++"):
            inside, start, current = True, number, []
        elif inside and stripped == "```":
            inside = False
            out.append((start, current))
        elif inside:
            current.append(line)
    return out


def occurs(needle, haystack):
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    sources = []
    for folder in ("examples", "tests", "bench", "tools"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".cpp", ".hpp") and path.is_file():
                sources.append((path, normalise(path.read_text(encoding="utf-8").split("\n"))))
    documents = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    missing, checked = [], 0
    for document in documents:
        for start, block in blocks(document):
            body = normalise(block)
            while body and not body[0]:
                body.pop(0)
            while body and not body[-1]:
                body.pop()
            if not body:
                continue
            checked += 1
            if not any(occurs(body, text) for _, text in sources):
                missing.append(f"{document.relative_to(root)}:{start}: this ```cpp block is in no file under "
                               "examples/, tests/, bench/ or tools/ (first line: " + body[0] + ")")
    for line in missing:
        print(line, file=sys.stderr)
    print(f"check_snippets: {checked} C++ blocks, {checked - len(missing)} found in compiled sources")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
