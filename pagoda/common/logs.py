"""How a process's log records reach stderr: today's text lines, or one JSON object a line.

Every service calls `configure_logging` once, after its settings are read; it leaves one
handler, on the root logger, so third-party loggers (grpc, uvicorn, transformers) that
propagate to the root come out in the same format. Under systemd stderr goes to journald;
the JSON lines are for shippers (Loki, Elasticsearch, Datadog, Kubernetes) that parse
each line as an object. Standard library only.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT_HELP = (  # every service's --help says it alike
    "text lines, or json: one JSON object per line (ts, level, logger, message, service and "
    "the record's own fields) for log shippers; third-party libraries' lines too"
)


def add_log_flags(parser) -> None:
    """--log-level and --log-format, as every service but the scheduler spells them."""
    add = parser.add_argument
    add("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="logging level")
    add("--log-format", default="text", type=str.lower, choices=LOG_FORMATS, help=LOG_FORMAT_HELP)


def log_setting_problems(log_level: str, log_format: str) -> list[str]:
    """The sentences for a log level or format a config may not hold (from a file or the
    environment, which argparse's choices do not see)."""
    problems = []
    if log_level not in LOG_LEVELS:
        problems.append(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
    if log_format not in LOG_FORMATS:
        problems.append(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    return problems


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What every LogRecord carries of its own; any other attribute came from a call's `extra=`.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",  # set by logging.Formatter.format
    "asctime",
    "color_message",  # uvicorn's copy of the message with ANSI colours, for terminals
}

log = logging.getLogger("pagoda.logs")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: `ts` (ISO 8601 UTC, milliseconds), `level`,
    `logger`, `message` (whole; a newline in it is escaped, so it cannot forge a line), the
    static fields, the call's `extra=` fields, then `exc_info` and `stack_info` as text
    when there are any. An extra field named like one before it is left out: those keys
    mean the same on every line. A value JSON cannot hold (an object, NaN) is its str()."""

    def __init__(self, static_fields: Mapping[str, Any]) -> None:
        super().__init__()
        self._static_fields = dict(static_fields)

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            "ts": _iso_utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self._static_fields,
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key not in fields:
                fields[str(key)] = value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            fields["exc_info"] = record.exc_text
        if record.stack_info:
            fields["stack_info"] = self.formatStack(record.stack_info)
        try:
            return _dumps(fields)
        except (TypeError, ValueError, RecursionError):
            # Rare: NaN, a circular or otherwise unserializable value. Only those fields
            # become text; the rest keep their JSON types.
            return _dumps({key: _json_value(value) for key, value in fields.items()})


def _iso_utc(created_s: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created_s))
    return f"{seconds}.{int(created_s % 1 * 1000):03d}Z"


def _dumps(fields: Mapping[str, Any]) -> str:
    # ASCII only: a line is valid whatever encoding stderr has, and U+2028 is escaped too.
    return json.dumps(fields, default=str, allow_nan=False)


def _json_value(value: Any) -> Any:
    try:
        json.dumps(value, default=str, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return str(value)
    return value


def text_format(static_fields: Mapping[str, Any]) -> str:
    """TEXT_FORMAT with each static field as `[name value]` before the colon
    (`... pagoda.worker [rank 1]: ...`, the tensor-parallel ranks' lines)."""
    tags = "".join(f" [{name} {value}]" for name, value in static_fields.items())
    return TEXT_FORMAT.replace("%(name)s:", "%(name)s" + tags.replace("%", "%%") + ":")


def configure_logging(level: str, log_format: str, *, service: str, **static_fields: Any) -> None:
    """Make one stderr handler on the root logger, replacing any (a torchrun rank configures
    twice), at `level` (DEBUG, INFO, WARNING or ERROR). `log_format` is one of LOG_FORMATS;
    `service` (scheduler, worker, openai) and `static_fields` go on every JSON line, the
    static fields alone on text lines. Both names are read case-blind. Under json,
    warnings and uncaught exceptions are logged too, so that every line of stderr is an
    object."""
    log_format = log_format.lower()
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter({"service": service, **static_fields}))
    else:
        handler.setFormatter(logging.Formatter(text_format(static_fields)))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if log_format == "json":
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(
    exc_type: type[BaseException], exc: BaseException, traceback: TracebackType | None
) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, traceback)
        return
    log.critical("uncaught exception", exc_info=(exc_type, exc, traceback))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if issubclass(args.exc_type, SystemExit):  # as threading's own hook: a quiet exit
        return
    name = args.thread.name if args.thread is not None else "?"
    log.critical(
        "uncaught exception in thread %s",
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )
