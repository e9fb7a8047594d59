"""The load generator: one asyncio process driving a server with a bounded workload.

Programmatic use:

    from pagoda.client.bench import BenchConfig, format_report_table, run_bench
    report = run_bench(BenchConfig(target="127.0.0.1:50051", arrival="poisson", rate_per_s=4))
    print(format_report_table({"poisson 4/s": report}))

From the shell: `pagoda bench --help` (or `python -m pagoda.client.bench --help`).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time
from typing import TextIO

from pagoda.client.async_client import AsyncClient
from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import BenchReport, RequestResult, format_report_table, summarize
from pagoda.client.bench_workload import arrival_offsets_s, build_prompts
from pagoda.client.errors import PagodaError

__all__ = [
    "BenchConfig",
    "BenchReport",
    "format_report_table",
    "main",
    "run_bench",
    "run_bench_async",
]

# The progress line is redrawn at most this often.
PROGRESS_INTERVAL_S = 0.1


def run_bench(config: BenchConfig, *, progress: TextIO | None = None) -> BenchReport:
    """Run one benchmark to completion (blocking); `progress` gets a live "\\r[###..]" line."""
    return asyncio.run(run_bench_async(config, progress=progress))


async def run_bench_async(config: BenchConfig, *, progress: TextIO | None = None) -> BenchReport:
    """`run_bench` for callers already inside an event loop."""
    run_tag = config.run_tag or secrets.token_hex(3)
    async with AsyncClient(
        config.target,
        api_key=config.api_key,
        tls_root_cert=config.tls_root_cert,
        timeout_s=config.request_timeout_s,
    ) as client:
        preemptions_before = await _num_preemptions(client)
        runner = _Runner(client, config, run_tag, _Progress(progress, config.num_requests))
        duration_s = await runner.run()
        preemptions_after = await _num_preemptions(client)
    num_preemptions = None
    if preemptions_before is not None and preemptions_after is not None:
        num_preemptions = preemptions_after - preemptions_before
    return summarize(config, run_tag, runner.results, duration_s, num_preemptions)


class _Runner:
    """Sends the requests of one run and records what each one saw."""

    def __init__(
        self, client: AsyncClient, config: BenchConfig, run_tag: str, progress: _Progress
    ) -> None:
        self.client = client
        self.config = config
        self.run_tag = run_tag
        self.prompts = build_prompts(config, run_tag)
        self.progress = progress
        self.results: list[RequestResult] = []
        self._next_index = 0
        self._start = 0.0

    async def run(self) -> float:
        """Run until every request ended or duration_s passed; the run's seconds."""
        self._start = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.duration_s), asyncio.TaskGroup() as group:
                if self.config.arrival == "closed":
                    for _ in range(self.config.num_users):
                        group.create_task(self._closed_loop_user())
                else:
                    await self._launch_open_loop(group)
        except TimeoutError:
            pass
        self.progress.finish(self.results)
        ends = [result.end_s for result in self.results if result.end_s is not None]
        if any(result.unfinished for result in self.results) or not ends:
            return self._now()
        return max(ends)

    async def _launch_open_loop(self, group: asyncio.TaskGroup) -> None:
        for index, offset_s in enumerate(arrival_offsets_s(self.config)):
            delay_s = offset_s - self._now()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            group.create_task(self._one(index))

    async def _closed_loop_user(self) -> None:
        # Single-threaded event loop: taking the next index needs no lock.
        while self._next_index < self.config.num_requests:
            index = self._next_index
            self._next_index += 1
            await self._one(index)

    async def _one(self, index: int) -> None:
        result = RequestResult(index=index, send_s=self._now())
        self.results.append(result)
        config = self.config
        try:
            stream = self.client.generate(
                self.prompts[index],
                max_new_tokens=config.max_new_tokens,
                ignore_eos=config.ignore_eos,
                temperature=config.temperature,
                seed=config.seed + index if config.temperature > 0 else None,
                request_id=f"bench-{self.run_tag}-{index}",
            )
            async with stream:
                async for chunk in stream:
                    if chunk.token_ids:
                        result.chunk_times_s.append(self._now())
                        result.chunk_num_tokens.append(len(chunk.token_ids))
                    if chunk.is_last:
                        result.finish_reason = chunk.finish_reason
                        result.usage = chunk.usage
                        result.timings = chunk.timings
            result.end_s = self._now()
        except PagodaError as exc:
            result.error_code = exc.code.name
            result.end_s = self._now()
        except asyncio.CancelledError:
            result.unfinished = True
            raise
        finally:
            self.progress.update(self.results)

    def _now(self) -> float:
        return time.perf_counter() - self._start


class _Progress:
    """`\\r[####....] 37/64 done, 2 errors` on a terminal stream, redrawn at most 10 times/s."""

    WIDTH = 30

    def __init__(self, stream: TextIO | None, total: int) -> None:
        self.stream = stream
        self.total = total
        self._last_draw = 0.0

    def update(self, results: list[RequestResult], force: bool = False) -> None:
        now = time.monotonic()
        if self.stream is None or (not force and now - self._last_draw < PROGRESS_INTERVAL_S):
            return
        self._last_draw = now
        done = sum(r.end_s is not None or r.unfinished for r in results)
        errors = sum(r.error_code is not None for r in results)
        filled = self.WIDTH * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r[{bar}] {done}/{self.total} done, {errors} errors")
        self.stream.flush()

    def finish(self, results: list[RequestResult]) -> None:
        if self.stream is not None:
            self.update(results, force=True)
            self.stream.write("\n")
            self.stream.flush()


async def _num_preemptions(client: AsyncClient) -> int | None:
    try:
        return (await client.server_stats()).num_preemptions
    except PagodaError:
        return None


def main(argv: list[str] | None = None) -> int:
    """`python -m pagoda.client.bench ...` is `pagoda bench ...`."""
    from pagoda.client.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
