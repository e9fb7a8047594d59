"""--log-format json on real processes: every line a service writes, from its start through
a request to its stop on SIGTERM, is one JSON object with the fixed keys."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import running_service, stop_process
from tests.openai_front.conftest import start_front

pytestmark = pytest.mark.slow

KEYS = {"ts", "level", "logger", "message", "service"}


@pytest.fixture(scope="module")
def json_logs(tmp_path_factory) -> dict[str, list[dict]]:
    """Scheduler, dummy worker and front, all with --log-format json, after one chat
    completion and a stop: each service's log file (stdout and stderr), line by line."""
    tmp_path = tmp_path_factory.mktemp("json-logs")
    front_log = tmp_path / "openai-front.log"
    json_format = ["--log-format", "json"]
    with running_service(
        tmp_path, model="dummy", worker_args=json_format, scheduler_args=json_format
    ) as service:
        process, url = start_front(service.address, front_log, *json_format)
        try:
            reply = httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
        finally:
            assert stop_process(process) == 0
    worker_log = next(tmp_path.glob("worker-*.log"))
    files = {"scheduler": tmp_path / "scheduler.log", "worker": worker_log, "openai": front_log}
    return {service: parse_lines(path) for service, path in files.items()}


def parse_lines(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"{path.name} line {number} is not JSON: {line!r}") from None
    return records


@pytest.mark.parametrize("service", ["scheduler", "worker", "openai"])
def test_every_line_is_a_json_object_with_the_fixed_keys(json_logs, service):
    records = json_logs[service]
    assert records, f"{service} logged nothing"
    for record in records:
        assert isinstance(record, dict) and record.keys() >= KEYS, record
        assert record["service"] == service


def test_the_fronts_uvicorn_lines_and_access_log_are_json_too(json_logs):
    loggers = {record["logger"] for record in json_logs["openai"]}
    assert {"uvicorn.error", "uvicorn.access"} <= loggers
    [access] = [r for r in json_logs["openai"] if "POST /v1/chat/completions" in r["message"]]
    assert access["message"].endswith(" 200") and "color_message" not in access
