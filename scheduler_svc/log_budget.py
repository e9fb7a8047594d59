"""A budget of log lines for what strangers can make the scheduler log (security review
N7): a peer that floods the worker endpoint with heartbeats it never reads made 36,525
warnings in 10 s. Past the budget, lines are counted, and the next one let through says
how many were left out."""

from __future__ import annotations

from dataclasses import dataclass, field

LINES_PER_INTERVAL = 10
INTERVAL_S = 10.0


@dataclass(slots=True)
class LogBudget:
    """Per kind of line (a fixed name in the code, never a peer's identity, so the table
    stays as small as the code's list of kinds)."""

    lines_per_interval: int = LINES_PER_INTERVAL
    interval_s: float = INTERVAL_S
    _window_start_s: dict[str, float] = field(default_factory=dict)
    _num_lines: dict[str, int] = field(default_factory=dict)
    _num_left_out: dict[str, int] = field(default_factory=dict)

    def take(self, kind: str, now_s: float) -> int | None:
        """None: leave this line out. Otherwise log it, with the number of lines of this
        kind left out since the last one logged (0 for none)."""
        if now_s - self._window_start_s.get(kind, -self.interval_s) >= self.interval_s:
            self._window_start_s[kind] = now_s
            self._num_lines[kind] = 0
        if self._num_lines[kind] >= self.lines_per_interval:
            self._num_left_out[kind] = self._num_left_out.get(kind, 0) + 1
            return None
        self._num_lines[kind] += 1
        return self._num_left_out.pop(kind, 0)
