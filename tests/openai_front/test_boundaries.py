"""The front is a client of the gRPC API: importing it loads neither process's code nor torch."""

from __future__ import annotations

from tests.unit.test_process_boundaries import import_everything


def test_the_front_imports_no_scheduler_worker_or_torch():
    modules, loaded = import_everything(
        "pagoda.openai_front", ["pagoda.scheduler_svc", "pagoda.gpu_worker", "torch"]
    )
    assert "pagoda.openai_front.app" in modules
    assert loaded == []
