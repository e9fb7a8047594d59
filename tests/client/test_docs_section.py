"""Generated sections of docs/benchmarks.md (benchmarks.docs_section) and `make bench
--write-docs`, on a temporary copy: the prose around a section stays, a re-run replaces it."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import docs_section, suite
from benchmarks.docs_section import markers, replace_section, section_body

PROSE = "# Benchmarks\n\nHand-written text.\n"


def test_a_new_section_is_appended_and_a_second_write_replaces_it():
    first = replace_section(PROSE, "make bench --device cuda", "old table")
    begin, end = markers("make bench --device cuda")
    assert first.startswith(PROSE.rstrip()) and first.rstrip().endswith(end)
    assert f"{begin}\nold table\n{end}" in first
    second = replace_section(first + "\nMore prose.\n", "make bench --device cuda", "new table")
    assert "old table" not in second and "new table" in second
    assert second.startswith(PROSE.rstrip()) and second.endswith("More prose.\n")
    other = replace_section(second, "make bench-worker --device cuda", "worker table")
    assert "new table" in other and "worker table" in other


def test_a_section_without_its_end_marker_is_refused():
    begin, _ = markers("x")
    with pytest.raises(ValueError, match="end generated"):
        replace_section(f"{begin}\nhalf", "x", "body")


def test_the_body_keeps_the_output_verbatim_in_a_text_block():
    body = section_body("make bench --device cuda", "| a | b |\n|---|---|\n", ["Device: H100"])
    lines = body.splitlines()
    assert lines[0] == "### make bench --device cuda"
    assert "Device: H100" in lines
    assert lines[-4:] == ["```text", "| a | b |", "|---|---|", "```"]


def test_the_cli_copies_a_saved_output(tmp_path, monkeypatch):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(PROSE)
    output = tmp_path / "worker.txt"
    output.write_text("decode, batch 64: 4.1 ms\n")
    name = "make bench-worker --device cuda"
    assert docs_section.main([name, str(output), "--docs", str(docs)]) == 0
    text = docs.read_text()
    assert (
        text.startswith(PROSE) and "decode, batch 64: 4.1 ms" in text and markers(name)[0] in text
    )


def test_the_suite_writes_what_it_printed_to_its_device_section(tmp_path, monkeypatch, capsys):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(PROSE)
    monkeypatch.setattr(docs_section, "DOCS_PATH", docs)
    tee = suite._Tee(__import__("sys").stdout)
    tee.write("== prefix-caching\n| table |\n")
    args = argparse.Namespace(device="cpu", quick=True)
    suite._write_docs(args, tee.getvalue(), 0.5)
    text = docs.read_text()
    assert markers("make bench-quick --device cpu")[0] in text
    assert "| table |" in text and "load average 0.50" in text
    assert "== prefix-caching" in capsys.readouterr().out  # the tee printed it too


def test_the_worker_bench_replaces_its_table_and_keeps_the_notes_under_it(tmp_path):
    """`make bench-worker --write-docs` once replaced everything from `## Worker` to the
    next `## `, the hand-written `###` notes under it included."""
    from benchmarks import worker_step

    docs = tmp_path / "benchmarks.md"
    begin, end = markers("make bench-worker")
    docs.write_text(
        f"{PROSE}\n## Worker\n\n{begin}\nold table\n{end}\n\nWhat the table shows.\n\n"
        "### Small steps\n\nNotes kept.\n\n## Next\n\nTail.\n"
    )
    worker_step.write_docs(docs, "cpu", "new table")
    worker_step.write_docs(docs, "cuda", "### cuda\n\ncuda table")
    text = docs.read_text()
    assert f"## Worker\n\n{begin}\nnew table\n{end}\n\nWhat the table shows." in text
    assert "old table" not in text
    assert "### Small steps\n\nNotes kept.\n\n## Next\n\nTail." in text
    assert text.rstrip().endswith(markers("make bench-worker --device cuda")[1])  # appended


def test_the_docs_hold_every_section_the_benches_write():
    """A run writes in place, not at the file's end: each section's markers are there."""
    from benchmarks import worker_step

    text = docs_section.DOCS_PATH.read_text()
    names = ["make bench --device cuda"] + [
        worker_step.docs_section_name(kind) for kind in ("cpu", "cuda")
    ]
    for name in names:
        begin, end = markers(name)
        assert (
            text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)
        )
