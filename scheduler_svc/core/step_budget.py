"""The step budget: how many prompt tokens a step may carry so that the sequences decoding
in it still get their next token within a target time (`target_step_ms`).

A step's worker time (forward + sample) is modelled as

    step_ms ~ a + b * num_prefill_tokens + c * num_decode_seqs + d * num_context_tokens

and learned online from each StepResult (StepCostModel). `num_context_tokens` is the KV the
step's attention reads: each sequence's context after the step (start position + tokens
fed), summed. A decode's cost grows with it (on a CPU the KV read of a 512-token context
is about 0.8 MB per layer): without it, a step of the same decode count costs more as its
sequences' contexts grow and the model learns that only late, one step behind. A step's prefill cap is then what
fits in the target once its decodes are paid for, never below a floor (a long prompt always
progresses) and never above the fixed token knobs (the planner takes the minimum). A step
with no decode in it has no stream to keep waiting: it is not capped.

Pure Python, no clock: the scheduler feeds the observations and asks for caps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Feature scales: each feature is about 1 on a typical step, so the 3x3 system stays well
# conditioned whatever the hardware's milliseconds are.
PREFILL_SCALE_TOKENS = 256.0
DECODE_SCALE_SEQS = 64.0
CONTEXT_SCALE_TOKENS = 64.0 * 256.0  # 64 decodes at 256-token contexts
NUM_FEATURES = 4  # intercept, prefill tokens, decode sequences, context tokens

# Weight of an observation decays by this factor each step: an effective window of about
# 1 / (1 - FORGETTING) = 25 steps, so a worker that slows down (another process took the
# cores) is followed within a few dozen steps.
FORGETTING = 0.96
# Pull towards the previous estimate, as a fraction of the window's total weight: small
# enough to be ignored where the data speak, it keeps a coefficient no recent step informs
# (no prefill in the last hundred steps) where it was instead of letting it drift to noise.
ANCHOR_FRACTION = 0.01
# Huber threshold on the relative error, in mean relative errors, and its floor: a step 3x
# slower than predicted once (a GC pause, a noisy neighbour) moves the estimate only as much
# as an error of the threshold would.
HUBER_K = 3.0
HUBER_MIN_RELATIVE = 0.25
MIN_STEP_MS = 1.0  # predictions below this are taken as this when weighting
# Step times above this (about 3 hours) are a worker's bad report, not a cost: ignored.
MAX_STEP_MS = 1e7
# How fast the residual scale follows (per step), and how far one residual may push it: a
# sustained change grows the scale geometrically, so the model adapts within a few steps.
SCALE_RATE = 0.1
SCALE_CLIP = 2.0
# An observation this far outside what the window has seen (its leverage: the weight it
# would carry in the fit) is never down-weighted: it is the only information about its
# direction (the first prefill after decode-only steps), not an outlier.
NEW_DIRECTION_LEVERAGE = 0.9
# Below this per-token cost (ms) the model knows nothing about prefill yet.
MIN_PREFILL_MS_PER_TOKEN = 1e-6

# A step predicted right at the target overruns it whenever the prediction errs low: about
# every other step. The cap aims that many recent mean relative errors below the target, so
# that the target bounds the gap between two tokens instead of being its median (the
# burst-512-mix workload on 2 cores: ITL p99 594-647 ms at a 500 ms target without it).
ERROR_MARGIN = 2.0

# The smallest prefill a capped step carries when anything waits: one KV block of 16 tokens
# costs about the same as 32 tokens on a CPU, and a long prompt must keep moving while the
# decodes alone fill the target.
MIN_PREFILL_TOKENS = 32


@dataclass(slots=True)
class StepCostModel:
    """step_ms ~ a + b * prefill tokens + c * decode sequences + d * context tokens, by
    exponentially weighted least squares with Huber weights, anchored to the previous
    estimate.

    The weighted sums are kept (4x4 and 4) and the system is solved after each observation
    (microseconds). Coefficients are clamped at zero: no work is free.
    """

    # Decayed sums of w * x x^T (row-major 4x4), of w * x * y and of w.
    _xx: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES * NUM_FEATURES)
    _xy: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    _weight: float = 0.0
    # Coefficients in scaled units (ms per scaled feature).
    _theta: list[float] = field(default_factory=lambda: [0.0] * NUM_FEATURES)
    _scale: float = 0.0  # mean relative error of predictions (exponentially weighted)
    num_observations: int = 0

    def reset(self) -> None:
        """Forget everything (a new worker may be another machine)."""
        self._xx = [0.0] * NUM_FEATURES * NUM_FEATURES
        self._xy = [0.0] * NUM_FEATURES
        self._weight = 0.0
        self._theta = [0.0] * NUM_FEATURES
        self._scale = 0.0
        self.num_observations = 0

    @property
    def intercept_ms(self) -> float:
        return self._theta[0]

    @property
    def prefill_ms_per_token(self) -> float:
        return self._theta[1] / PREFILL_SCALE_TOKENS

    @property
    def decode_ms_per_seq(self) -> float:
        return self._theta[2] / DECODE_SCALE_SEQS

    @property
    def context_ms_per_token(self) -> float:
        """Per token of context attended (each sequence's, summed over the step)."""
        return self._theta[3] / CONTEXT_SCALE_TOKENS

    @property
    def relative_error(self) -> float:
        """Mean relative error of recent predictions (0 before two observations)."""
        return self._scale

    def predict_ms(
        self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int = 0
    ) -> float:
        return _dot(self._theta, _features(num_prefill_tokens, num_decode_seqs, num_context_tokens))

    def observe(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        step_ms: float,
        num_context_tokens: int = 0,
    ) -> None:
        """One step's worker time for its shape. Times outside [0, MAX_STEP_MS] (NaN
        included) are ignored: one absurd report must not poison the model or overflow.

        Errors are relative (a 1.5 s prefill step is as noisy in percent as a 100 ms decode
        step, not in milliseconds), so each observation is weighted by 1 / predicted^2: the
        few milliseconds a decode costs are not drowned by the noise of long steps.
        """
        if not 0 <= step_ms <= MAX_STEP_MS or num_prefill_tokens + num_decode_seqs <= 0:
            return
        x = _features(num_prefill_tokens, num_decode_seqs, num_context_tokens)
        if self.num_observations:
            predicted_ms = max(_dot(self._theta, x), MIN_STEP_MS)
            relative_error = abs(step_ms - predicted_ms) / predicted_ms
            threshold = max(HUBER_K * self._scale, HUBER_MIN_RELATIVE)
            weight = 1.0 / (predicted_ms * predicted_ms)
            if relative_error > threshold and self._leverage(x, weight) < NEW_DIRECTION_LEVERAGE:
                weight *= threshold / relative_error
            clipped = min(relative_error, SCALE_CLIP * threshold)
            if self.num_observations == 1:
                self._scale = clipped
            else:
                self._scale += SCALE_RATE * (clipped - self._scale)
        else:
            first_ms = max(step_ms, MIN_STEP_MS)
            weight = 1.0 / (first_ms * first_ms)
        xx, xy = self._xx, self._xy
        self._weight = FORGETTING * self._weight + weight
        for i in range(NUM_FEATURES):
            xy[i] = FORGETTING * xy[i] + weight * x[i] * step_ms
            row = i * NUM_FEATURES
            for j in range(NUM_FEATURES):
                xx[row + j] = FORGETTING * xx[row + j] + weight * x[i] * x[j]
        self.num_observations += 1
        self._solve()

    def _solve(self) -> None:
        """theta = argmin sum w (y - theta.x)^2 + anchor * |theta - theta_prev|^2, clamped
        at zero."""
        theta = self._theta
        anchor = ANCHOR_FRACTION * self._weight
        rhs = [self._xy[i] + anchor * theta[i] for i in range(NUM_FEATURES)]
        solved = _solve_linear(self._anchored(anchor), rhs)
        if solved is not None:
            self._theta = [max(0.0, value) for value in solved]

    def _leverage(self, x: list[float], weight: float) -> float:
        """The share of the fit an observation at `x` of `weight` carries (the diagonal of
        the weighted hat matrix): about NUM_FEATURES / window inside the data, near 1
        outside it."""
        anchor = ANCHOR_FRACTION * self._weight
        solved = _solve_linear(self._anchored(anchor), list(x))
        return weight * _dot(x, solved) if solved is not None else math.inf

    def _anchored(self, anchor: float) -> list[list[float]]:
        return [
            [
                self._xx[i * NUM_FEATURES + j] + (anchor if i == j else 0.0)
                for j in range(NUM_FEATURES)
            ]
            for i in range(NUM_FEATURES)
        ]


@dataclass(slots=True)
class StepBudget:
    """The prefill-token cap of each step under `target_step_ms`, from a StepCostModel."""

    target_step_ms: float
    min_prefill_tokens: int = MIN_PREFILL_TOKENS
    model: StepCostModel = field(default_factory=StepCostModel)
    # The cap of the last step planned (None: uncapped); for metrics.
    last_cap_tokens: int | None = None

    def reset(self) -> None:
        self.model.reset()
        self.last_cap_tokens = None

    def max_prefill_tokens(
        self, num_decode_seqs: int, num_context_tokens: int = 0, num_rounds: int = 1
    ) -> int | None:
        """Prompt tokens a step with `num_decode_seqs` decodes may carry when it attends
        `num_context_tokens` besides its prompt tokens (the decoders' contexts, the earlier
        positions of prompts it continues); None: no cap from the budget (no decode waits
        on this step, or no prefill has been measured yet).

        `num_rounds`: steps a decoder waits for its next token (under a decode cap the
        round-robin serves each one every `num_rounds` steps), so each step gets that share
        of the target: the target bounds the gap between two tokens of a stream, not one
        step (issue 24 item 9: 36 decoders under a cap of 8 waited five full steps)."""
        cap = None
        if num_decode_seqs > 0:
            cap = prefill_cap(
                self.model,
                self.target_step_ms / max(1, num_rounds),
                num_decode_seqs,
                self.min_prefill_tokens,
                num_context_tokens,
            )
        self.last_cap_tokens = cap
        return cap

    def observe(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        step_ms: float,
        num_context_tokens: int = 0,
    ) -> None:
        self.model.observe(num_prefill_tokens, num_decode_seqs, step_ms, num_context_tokens)


def prefill_cap(
    model: StepCostModel,
    target_step_ms: float,
    num_decode_seqs: int,
    min_prefill_tokens: int,
    num_context_tokens: int = 0,
) -> int | None:
    """The prompt tokens that fit in `target_step_ms` beside `num_decode_seqs` decodes, at
    least `min_prefill_tokens`; None while the model has no per-token cost.
    `num_context_tokens` is the context attended besides the prompt tokens; each prompt
    token adds one more (its own position).
    """
    per_token_ms = model.prefill_ms_per_token
    if per_token_ms < MIN_PREFILL_MS_PER_TOKEN:
        return None
    aim_ms = target_step_ms / (1.0 + ERROR_MARGIN * model.relative_error)
    left_ms = aim_ms - model.predict_ms(0, num_decode_seqs, num_context_tokens)
    if left_ms <= 0:
        return min_prefill_tokens
    per_token_ms += model.context_ms_per_token
    # The bound keeps the int conversion finite; the planner's knobs cap it far lower.
    return max(min_prefill_tokens, int(min(left_ms / per_token_ms, 1e9)))


def _features(
    num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int
) -> list[float]:
    return [
        1.0,
        num_prefill_tokens / PREFILL_SCALE_TOKENS,
        num_decode_seqs / DECODE_SCALE_SEQS,
        num_context_tokens / CONTEXT_SCALE_TOKENS,
    ]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular. Consumes its inputs."""
    n = len(rhs)
    for col in range(n):
        pivot = max(range(col, n), key=lambda row: abs(matrix[row][col]))
        if abs(matrix[pivot][col]) < 1e-12:
            return None
        if pivot != col:
            matrix[col], matrix[pivot] = matrix[pivot], matrix[col]
            rhs[col], rhs[pivot] = rhs[pivot], rhs[col]
        inverse = 1.0 / matrix[col][col]
        for row in range(col + 1, n):
            factor = matrix[row][col] * inverse
            if factor:
                for k in range(col, n):
                    matrix[row][k] -= factor * matrix[col][k]
                rhs[row] -= factor * rhs[col]
    solution = [0.0] * n
    for row in range(n - 1, -1, -1):
        total = rhs[row] - sum(matrix[row][k] * solution[k] for k in range(row + 1, n))
        solution[row] = total / matrix[row][row]
    return solution
