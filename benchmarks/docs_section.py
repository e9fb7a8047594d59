"""Write a generated section of docs/benchmarks.md: `python -m benchmarks.docs_section`.

A generated section lies between two HTML comments naming it, so a re-run replaces it
and the hand-written prose around it stays:

    <!-- generated: make bench --device cuda -->
    ...
    <!-- end generated: make bench --device cuda -->

A section not there yet is appended at the end of the file. `make bench --write-docs` and
`make bench-worker --write-docs FILE` write their own; for any other tool, save its output
and copy it in:

    make bench-scheduler | tee /tmp/scheduler.txt
    .venv/bin/python -m benchmarks.docs_section "make bench-scheduler" /tmp/scheduler.txt
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- generated: {name} -->", f"<!-- end generated: {name} -->"


def replace_section(document: str, name: str, body: str) -> str:
    """`document` with section `name` holding `body` (replaced, or appended if absent)."""
    begin, end = markers(name)
    block = f"{begin}\n{body.rstrip()}\n{end}"
    start = document.find(begin)
    if start < 0:
        return f"{document.rstrip()}\n\n{block}\n"
    stop = document.find(end, start)
    if stop < 0:
        raise ValueError(f"{begin!r} has no {end!r} after it")
    return document[:start] + block + document[stop + len(end) :]


def section_body(title: str, transcript: str, notes: list[str] = ()) -> str:
    """A heading, when and where it ran, and the tool's output verbatim."""
    lines = [f"### {title}", ""]
    lines.append(
        f"Generated {datetime.datetime.now().astimezone().isoformat(timespec='minutes')} on "
        f"{platform.node() or 'this host'} ({platform.machine()}, Python "
        f"{platform.python_version()})."
    )
    lines += [f"{note}" for note in notes]
    lines += ["", "```text", transcript.rstrip(), "```"]
    return "\n".join(lines)


def write_section(name: str, body: str, path: Path | None = None) -> None:
    path = path or DOCS_PATH
    path.write_text(replace_section(path.read_text(), name, body))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.docs_section", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("name", help='the section, e.g. "make bench-scheduler"')
    parser.add_argument("output", help="a file holding the tool's output, or - for stdin")
    parser.add_argument("--docs", type=Path, default=DOCS_PATH, help="the markdown file")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.output == "-" else Path(args.output).read_text()
    write_section(args.name, section_body(args.name, text), args.docs)
    print(f"wrote section {args.name!r} of {args.docs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
