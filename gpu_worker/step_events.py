"""Where a step's host waits for its device: once, after the sampled tokens' copy.

A step enqueues its forward (or graph replay) and its sampling without waiting, starts
the sampled tokens' copy into pinned host memory (non_blocking, `HostCopy`) and waits on
an event recorded after that copy when it reads them, so the host prepares the sampling
while the forward runs, and a step launched ahead (engine.py) is enqueued before the
step before it is read. A step that samples nothing ends the same way, on an event
(`DeviceEvent`): the step after the next reuses pinned staging buffers (cuda_graphs.py)
that this step's copies may still be reading. No call waits for the whole device
(torch.cuda.synchronize), only for this stream's work.

On CPU the same calls run and the events do nothing: the work is done when the call
returns. `StepClock` gives a step's forward and sampling times: on CUDA the forward's is
device time between two timing events (read after the wait) and the sampling's is the
rest of the step's wall time, so their sum stays the step's wall time on either device.
"""

from __future__ import annotations

import time

import torch


class DeviceEvent:
    """A CUDA event on the device's current stream, or nothing on a CPU."""

    __slots__ = ("_event",)

    def __init__(self, device: torch.device, *, timing: bool = False) -> None:
        self._event = None
        if device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=timing)

    def record(self) -> DeviceEvent:
        if self._event is not None:
            self._event.record()
        return self

    def synchronize(self) -> None:
        """Wait until the work enqueued before `record` is done (at once on a CPU)."""
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        """Whether the work enqueued before `record` is done, without waiting (a CPU: yes)."""
        return self._event is None or self._event.query()

    def elapsed_ms(self, later: DeviceEvent) -> float | None:
        """Device milliseconds from this event to `later` (both timing, both done)."""
        if self._event is None or later._event is None:
            return None
        return self._event.elapsed_time(later._event)


def upload(
    values: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(host tensor, device tensor) of `values`: one copy, from pinned memory and not
    waited for on CUDA (the host tensor itself on a CPU)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host, host
    host = host.pin_memory()
    return host, host.to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host: on CUDA one non_blocking copy
    into pinned memory, enqueued at once, and an event recorded after it; on a CPU the
    tensor itself (and an event that does nothing)."""

    __slots__ = ("_host", "_copied")

    def __init__(self, tensor: torch.Tensor) -> None:
        host = tensor
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        self._host = host
        self._copied = DeviceEvent(tensor.device).record()

    def done(self) -> bool:
        return self._copied.query()

    def read(self) -> torch.Tensor:
        """The values, once the copy is done (the one wait)."""
        self._copied.synchronize()
        return self._host


class StepClock:
    """A step's start and end of forward, on the host's clock and (CUDA) the device's."""

    __slots__ = ("device", "_started_s", "_forward_done_s", "_start", "_forward_done")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._started_s = time.perf_counter()
        self._forward_done_s = self._started_s
        self._start = DeviceEvent(device, timing=True).record()
        self._forward_done = DeviceEvent(device, timing=True)

    def forward_enqueued(self) -> None:
        self._forward_done_s = time.perf_counter()
        self._forward_done.record()

    def timings_ms(self) -> tuple[float, float]:
        """(forward_ms, sample_ms); call after the step's wait (HostCopy.read or
        DeviceEvent.synchronize), when the forward's events are done."""
        total_ms = (time.perf_counter() - self._started_s) * 1e3
        forward_ms = self._start.elapsed_ms(self._forward_done)
        if forward_ms is None:  # a CPU: the forward was done when it returned
            forward_ms = (self._forward_done_s - self._started_s) * 1e3
        return forward_ms, max(total_ms - forward_ms, 0.0)
