"""pagoda.common.logs: the JSON lines (fields, extra, tracebacks, escaping) and the text
format the services had before it."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys

import pytest

from pagoda.common.logs import TEXT_FORMAT, JsonFormatter, text_format

ISO_UTC_MS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def logged_lines(emit, formatter: logging.Formatter) -> list[str]:
    """The lines `emit(logger)` writes through one handler with `formatter`."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("pagoda.test_logs")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    return stream.getvalue().splitlines()


def json_records(emit, **static_fields) -> list[dict]:
    formatter = JsonFormatter({"service": "scheduler", **static_fields})
    return [json.loads(line) for line in logged_lines(emit, formatter)]


def test_a_record_has_the_fixed_fields_and_the_static_ones():
    [record] = json_records(lambda log: log.warning("worker %s lost", "w1"), rank=2)
    assert list(record) == ["ts", "level", "logger", "message", "service", "rank"]
    assert ISO_UTC_MS.fullmatch(record["ts"])
    assert record["level"] == "WARNING" and record["logger"] == "pagoda.test_logs"
    assert record["message"] == "worker w1 lost"
    assert (record["service"], record["rank"]) == ("scheduler", 2)


def test_extra_fields_keep_their_json_types():
    [record] = json_records(
        lambda log: log.info("step", extra={"step_ms": 3.2, "rows": [1, 2], "ok": True})
    )
    assert (record["step_ms"], record["rows"], record["ok"]) == (3.2, [1, 2], True)


def test_an_extra_cannot_replace_a_fixed_field():
    [record] = json_records(lambda log: log.info("m", extra={"service": "x", "ts": 1}))
    assert record["service"] == "scheduler" and isinstance(record["ts"], str)


def test_values_json_cannot_hold_become_text():
    class Opaque:
        def __str__(self) -> str:
            return "opaque!"

    loop: list = []
    loop.append(loop)
    [record] = json_records(
        lambda log: log.info(
            "m", extra={"obj": Opaque(), "nan": float("nan"), "loop": loop, "n": 1}
        )
    )
    assert record["obj"] == "opaque!" and record["nan"] == "nan"
    assert record["loop"] == "[[...]]" and record["n"] == 1


def test_an_exception_is_one_field_of_one_line():
    def emit(log: logging.Logger) -> None:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("step failed")

    [line] = logged_lines(emit, JsonFormatter({"service": "worker"}))
    record = json.loads(line)
    assert record["level"] == "ERROR" and record["message"] == "step failed"
    assert record["exc_info"].startswith("Traceback (most recent call last):")
    assert record["exc_info"].endswith("RuntimeError: boom")


def test_a_newline_cannot_forge_a_line_and_nothing_is_cut():
    forged = 'x\n{"level": "INFO", "message": "forged"}'
    long_text = "y" * 100_000
    lines = logged_lines(
        lambda log: (log.info("prompt: %s", forged), log.info(long_text)),
        JsonFormatter({"service": "openai"}),
    )
    assert len(lines) == 2
    assert json.loads(lines[0])["message"] == "prompt: " + forged
    assert json.loads(lines[1])["message"] == long_text


def test_text_is_the_format_the_services_had():
    assert TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s: %(message)s"
    assert text_format({}) == TEXT_FORMAT
    assert text_format({"rank": 1}) == "%(asctime)s %(levelname)s %(name)s [rank 1]: %(message)s"
    [line] = logged_lines(
        lambda log: log.info("joined", extra={"step_ms": 1}),
        logging.Formatter(text_format({"rank": "50%"})),
    )
    assert line.endswith(" INFO pagoda.test_logs [rank 50%]: joined")


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_configure_logging_routes_every_logger_and_json_catches_the_rest(log_format):
    """In a child process: it replaces the root's handlers, so this one stays as it is."""
    script = f"""
import logging, threading, warnings
from pagoda.common.logs import configure_logging
logging.basicConfig(format="old %(message)s")
configure_logging("info", "{log_format}", service="worker", rank=1)
logging.getLogger("grpc._cython").warning("from a library")
logging.getLogger("pagoda.worker").debug("below the level")
warnings.warn("deprecated thing")
thread = threading.Thread(target=lambda: 1 / 0, name="t1")
thread.start()
thread.join()
raise ValueError("at the top")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    if log_format == "text":
        assert re.search(r" WARNING grpc._cython \[rank 1\]: from a library$", lines[0])
        assert "old " not in result.stderr and "below the level" not in result.stderr
        return
    records = [json.loads(line) for line in lines]
    assert [(r["logger"], r["level"]) for r in records] == [
        ("grpc._cython", "WARNING"),
        ("py.warnings", "WARNING"),
        ("pagoda.logs", "CRITICAL"),
        ("pagoda.logs", "CRITICAL"),
    ]
    assert all(r["service"] == "worker" and r["rank"] == 1 for r in records)
    assert "deprecated thing" in records[1]["message"]
    assert records[2]["message"] == "uncaught exception in thread t1"
    assert records[2]["exc_info"].endswith("ZeroDivisionError: division by zero")
    assert records[3]["exc_info"].endswith("ValueError: at the top")
