#!/usr/bin/env python3
"""Checks every relative link of the README, BENCHMARKS.md and the guide (docs/src):
the file it names exists, and so does the heading its #anchor names (mdBook's and the
forge's rule: lowercase, punctuation dropped, spaces as hyphens, -1, -2 for repeats).
External links are not followed (CI has no network beyond its registries)."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(path):
    """The lines of a Markdown file outside its code blocks."""
    inside = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            inside = not inside
        elif not inside:
            yield number, line


def slug(heading):
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return "".join(c if c.isalnum() or c in "-_" else "-" if c == " " else "" for c in text)


def anchors(path):
    seen = {}
    for _, line in prose(path):
        match = re.match(r"^#{1,6} (.*)$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            yield base if count == 0 else f"{base}-{count}"


def main():
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs/src").glob("*.md"))]
    failures = []
    for path in files:
        for number, line in prose(path):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}:{number}: {target}"
                if not linked.exists():
                    failures.append(f"{where}: no such file")
                elif anchor and linked.suffix == ".md" and anchor not in set(anchors(linked)):
                    failures.append(f"{where}: no heading #{anchor} in {linked.relative_to(ROOT)}")
    summary = ROOT / "docs/src/SUMMARY.md"
    listed = {m for _, line in prose(summary) for m in LINK.findall(line)}
    for chapter in sorted((ROOT / "docs/src").glob("*.md")):
        if chapter.name != "SUMMARY.md" and chapter.name not in listed:
            failures.append(f"docs/src/{chapter.name}: not in SUMMARY.md")
    for failure in failures:
        print(failure)
    if failures:
        sys.exit(f"{len(failures)} broken link(s)")
    print(f"links: {len(files)} files checked, none broken")


main()
