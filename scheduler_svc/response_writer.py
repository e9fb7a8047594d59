"""Writes a request's outputs to its gRPC stream as pagoda.v1.GenerateResponse messages.

One sample's outputs in order, or n samples' interleaved as they come, each tagged with
its index; an ERROR output ends the call with its slot's status, and a client that stops
reading has its stream ended (WriteWatch) so it holds no memory. Part of the servicer's
edge: the slots it reads come from the serving front (output_streams.py).
"""

from __future__ import annotations

import asyncio

import grpc

from pagoda.protos import generation_pb2
from pagoda.scheduler_svc.access_log import CallRecord
from pagoda.scheduler_svc.core import FinishReason, RequestOutput, Usage
from pagoda.scheduler_svc.metrics import Metrics
from pagoda.scheduler_svc.refusals import refusal
from pagoda.scheduler_svc.responses import to_response, to_usage, total_usage
from pagoda.scheduler_svc.sample_edge import SampleEdge
from pagoda.scheduler_svc.tokenizer import TextTokenizer
from pagoda.scheduler_svc.write_watch import StalledWrite, WriteWatch


class ResponseWriter:
    """Streams the outputs of the servicer's requests; one per servicer."""

    def __init__(self, metrics: Metrics, tokenizer: TextTokenizer, write_watch: WriteWatch) -> None:
        self._metrics = metrics
        self._tokenizer = tokenizer
        self._write_watch = write_watch

    def _token_bytes(self, token_id: int) -> bytes:
        return self._tokenizer.logprob_bytes(token_id)

    async def stream(
        self,
        context,
        slot,
        output: RequestOutput,
        request_id: str,
        tenant: str,
        index: int = 0,
        usages: list[Usage | None] | None = None,
        record: CallRecord | None = None,
        edge: SampleEdge | None = None,
    ) -> None:
        """Write one output of a sample; an ERROR ends the call with the slot's status
        (every other sample is cancelled). With `usages` (n > 1: each sample's final
        usage, by index, None until it ends), the last sample to end also carries the
        request's total_usage. `record` (the access log) hears each finishing output.
        `edge` reads the sample's text first (a thinking model's reasoning, streamed
        calls of tools)."""
        if output.finish_reason is FinishReason.ERROR:
            if output.token_ids or output.text:
                response = to_response(output, request_id, self._token_bytes, index)
                for message in _read(response, output, edge):
                    await self._write(context, message)
            code = getattr(grpc.StatusCode, slot.error_code or "INTERNAL")
            raise refusal(self._metrics, code, output.error_message or "the request failed")
        messages = _read(to_response(output, request_id, self._token_bytes, index), output, edge)
        if output.finish_reason is not None:
            self._metrics.observe_tenant_finish(tenant, output)
            if record is not None:
                record.finished(output, index)
            if usages is not None:
                usages[index] = output.usage
                if all(usage is not None for usage in usages):
                    messages[-1].total_usage.CopyFrom(to_usage(total_usage(usages)))
        for message in messages:
            await self._write(context, message)

    async def stream_samples(
        self,
        context,
        slots: list,
        request_id: str,
        tenant: str,
        record: CallRecord | None = None,
        edges: list[SampleEdge | None] | None = None,
    ) -> None:
        """Stream n samples' outputs as they come, each tagged with its index
        (`edges`: each one's, as stream's `edge`); returns once every sample has
        ended. Each slot is read by one task at a time, so a sample's messages stay in
        order and none is lost or repeated."""
        edges = edges or [None] * len(slots)
        usages: list[Usage | None] = [None] * len(slots)
        reading = {asyncio.ensure_future(slot.next()): index for index, slot in enumerate(slots)}
        try:
            while reading:
                done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=reading.__getitem__):
                    index = reading.pop(task)
                    output = task.result()
                    await self.stream(
                        context,
                        slots[index],
                        output,
                        request_id,
                        tenant,
                        index,
                        usages,
                        record,
                        edges[index],
                    )
                    if output.finish_reason is None:
                        reading[asyncio.ensure_future(slots[index].next())] = index
        finally:
            for task in reading:
                task.cancel()

    async def _write(self, context, response: generation_pb2.GenerateResponse) -> None:
        """Write one message; a client that takes none for stream_write_timeout_s (flow
        control full: it stopped reading) has its stream ended, so it holds no memory."""
        gone = False
        try:
            await self._write_watch.write(context.write(response))
            return
        except StalledWrite:
            pass
        except grpc.aio.InternalError:
            # grpc refused the write: the call is over (its connection closed while the
            # write waited). An ending like a cancel, not a traceback per stream (N7).
            gone = True
        if gone:
            raise asyncio.CancelledError
        raise refusal(
            self._metrics,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            self._write_watch.stalled_sentence,
            stalled=True,
        )


def _read(
    response: generation_pb2.GenerateResponse, output: RequestOutput, edge: SampleEdge | None
) -> list[generation_pb2.GenerateResponse]:
    """The messages to write for `response` (of `output`): itself, or as `edge` reads it."""
    return [response] if edge is None else edge.apply(response, output)
