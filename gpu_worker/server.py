"""The worker's ZeroMQ loop: a DEALER connected to the scheduler's ROUTER.

Conversation (protos/step.proto): HELLO every second until a HELLO_ACK; a refusal
exits with code 2; an ack from a scheduler incarnation we have not served before, or
the ack that follows a REHELLO, resets the engine. Then each PLAN gets exactly one
RESULT; HEARTBEAT every second of silence, and every 0.5 s of a long step for at most
--hang-timeout-s (gpu_worker/step_pulse.py: a long step is not a lost worker, a hung one
is); REHELLO sends HELLO again. A plan whose masks follow (StepPlan.masks_follow) runs
its forward, then the engine waits for its MASKS (`wait_masks`): on this thread, the
socket taken back from the pulse, heartbeats sent meanwhile, any other message kept for
the loop in arrival order. They come within about a step (the scheduler sends them once
the step before is answered); after MASKS_TIMEOUT_S, or at once on a REHELLO (a
scheduler that does not know us sends none), the step fails (step_error: its sequences
forgotten, the scheduler recomputes them) instead of hanging. MASKS for a step not waited
for (it failed or never ran) are dropped. Malformed frames are logged and skipped. SIGTERM/SIGINT
let the plan being run finish and answer, send GOODBYE (the scheduler then recomputes
the plans left unstarted without suspecting their requests), close the socket and exit
0. Imports no torch.

With --launch-ahead (the engine's `launches_ahead`), while a step's device work runs the
loop polls for the next PLAN and, when the engine may launch it ahead, launches it before
it reads and answers the step before (engine.py); results still go out one per plan, in
order. Any other message received meanwhile waits for the loop, in arrival order.

Under tensor parallelism this is rank 0, and `group` (tensor_parallel.GroupLeader) hears of
every plan (its frames) and reset before the engine runs it; a lost group exits
EXIT_GROUP_LOST.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections import deque

import zmq

from pagoda.common import curve, step_codec, transport, wire
from pagoda.common.step import StepMasks, StepPlan
from pagoda.common.systemd import notify, watchdog_interval_s
from pagoda.gpu_worker.engine import Engine, Launched, one_line
from pagoda.gpu_worker.step_pulse import StepPulse
from pagoda.protos import step_pb2

log = logging.getLogger("pagoda.worker.server")

EXIT_OK = 0
EXIT_REFUSED = 2
EXIT_GROUP_LOST = 3  # a tensor-parallel rank died: restartable (systemd), unlike 2
HELLO_INTERVAL_S = 1.0
HEARTBEAT_INTERVAL_S = 1.0
# While a long step runs (step_pulse.py): a beat within 1 s of its start, then every 0.5 s,
# so a scheduler timeout of 2 s or more is never a race with the next one.
STEP_HEARTBEAT_INTERVAL_S = 0.5
# A step running longer than this is taken as hung (--hang-timeout-s).
DEFAULT_HANG_TIMEOUT_S = 300.0
# Longest wait in poll, so a stop signal is noticed promptly.
POLL_SLICE_MS = 100
# How long a stopping worker's close waits for its last result and goodbye to leave.
GOODBYE_LINGER_MS = 1000
# While a step launched (or launched ahead) is on the device, the socket is polled for the
# next plan in slices this long (it comes about a quarter of a step before the end).
AHEAD_POLL_MS = 1
# --launch-ahead on a CPU: how long a done step waits for the next plan (tests only).
CPU_AHEAD_WAIT_S = 0.05
# Longest wait for the masks that follow a plan, from the end of its forward; they come
# within about a step, unless the scheduler is gone (then the step fails).
MASKS_TIMEOUT_S = 10.0


class MasksNotComing(RuntimeError):
    """The masks a step waits for will not come (in time): the step fails."""


def prepare_endpoint(endpoint: str) -> None:
    """An ipc socket's directory must exist and be private: created 0700 when missing,
    UnsafeSocketDirectory when another user could replace the socket."""
    transport.prepare_ipc_directory(endpoint)


class WorkerServer:
    def __init__(
        self,
        engine: Engine,
        endpoint: str,
        curve_client: tuple[curve.KeyPair, bytes] | None = None,
        group=None,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
    ) -> None:
        """`curve_client`: this worker's CurveZMQ keys and the scheduler's public key;
        `group`: the tensor-parallel ranks to keep in step (send_plan, send_reset,
        keepalive, lost), None for a single-process worker; `hang_timeout_s`: how long
        one step is vouched for by heartbeats (0: never)."""
        self.engine = engine
        self.group = group
        self.endpoint = endpoint
        self._curve_client = curve_client
        self.incarnation_id = uuid.uuid4().hex
        self._scheduler_incarnation_id: str | None = None
        self._acknowledged = False
        # A REHELLO means the scheduler holds nothing of ours (it dropped us or never knew
        # this connection): the sequences we hold are garbage once it acks our hello.
        self._forgotten = False
        self._last_hello_s = float("-inf")
        self._last_sent_s = float("-inf")
        self._stop_requested = False
        self._stop_reason = "stop requested"
        self._ready_notified = False
        self._watchdog_interval_s = watchdog_interval_s()
        self._last_watchdog_s = float("-inf")
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._hang_timeout_s = hang_timeout_s
        # Held by this thread whenever it may use the socket; let go only while the engine
        # computes, when the pulse may send (run() makes the pulse).
        self._socket_lock = threading.Lock()
        self._pulse: StepPulse | None = None
        # Messages received while the engine waited for masks, for the loop, oldest first.
        self._deferred: deque[list[bytes]] = deque()
        self.num_steps = 0
        self.num_launched_ahead = 0  # steps launched before the one before them was read
        self.masks_timeout_s = MASKS_TIMEOUT_S
        engine.wait_masks = self.wait_masks

    def hello(self) -> step_pb2.Hello:
        return step_codec.encode_hello(
            self.engine.facts,
            protocol_version=wire.PROTOCOL_VERSION,
            incarnation_id=self.incarnation_id,
            feeds_last_sampled=True,  # SequenceTable substitutes last_sampled_rows
        )

    def request_stop(self, signum: int = 0, frame=None) -> None:
        if signum:
            self._stop_reason = signal.Signals(signum).name
        self._stop_requested = True

    def run(self) -> int:
        """Serve until a stop signal (exit 0) or a refused hello (exit 2)."""
        prepare_endpoint(self.endpoint)
        socket = self._context.socket(zmq.DEALER)
        transport.configure(socket)
        # Queue nothing for a scheduler that is not there: a restarted one must not
        # receive a burst of stale hellos and heartbeats.
        socket.setsockopt(zmq.IMMEDIATE, 1)
        if self._curve_client is not None:
            curve.make_client(socket, *self._curve_client)
        socket.connect(self.endpoint)
        self._socket = socket
        previous = {
            sig: signal.signal(sig, self.request_stop) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        log.info(
            "worker %s connecting to %s%s (%s, %d KV blocks of %d tokens)",
            self.incarnation_id[:8],
            self.endpoint,
            " over CurveZMQ" if self._curve_client else "",
            self.engine.facts.model_id,
            self.engine.facts.num_kv_blocks,
            self.engine.facts.block_size,
        )
        linger_ms = 0
        self._socket_lock.acquire()
        self._pulse = StepPulse(
            self._beat, self._socket_lock, self._hang_timeout_s, STEP_HEARTBEAT_INTERVAL_S
        )
        try:
            exit_code = self._serve()
            if exit_code == EXIT_OK and self._acknowledged:
                # Stopped on purpose: no request in the plans left unstarted is to blame.
                goodbye = step_pb2.Goodbye(
                    incarnation_id=self.incarnation_id, reason=self._stop_reason
                )
                if self._send(goodbye):
                    linger_ms = GOODBYE_LINGER_MS
            return exit_code
        finally:
            self._pulse.close()
            self._pulse = None
            self._socket_lock.release()
            socket.close(linger=linger_ms)
            self._socket = None
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _serve(self) -> int:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop_requested:
            if self._group_lost():
                return EXIT_GROUP_LOST
            self._send_timers()
            if self._deferred:
                frames = self._deferred.popleft()
            elif not poller.poll(POLL_SLICE_MS):
                continue
            else:
                try:
                    frames = self._socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
            exit_code = self._handle(frames)
            if exit_code is not None:
                return exit_code
        if self.engine.launches_ahead:
            log.info("%d of %d steps were launched ahead", self.num_launched_ahead, self.num_steps)
        log.info("%s; saying goodbye and closing", self._stop_reason)
        notify("STOPPING=1")
        return EXIT_OK

    def _send_timers(self) -> None:
        now_s = time.monotonic()
        if now_s - self._last_watchdog_s >= self._watchdog_interval_s:
            notify("WATCHDOG=1")  # systemd's keep-alive: this loop is turning
            self._last_watchdog_s = now_s
        if not self._acknowledged:
            # A hello that could not be sent (not connected yet) is retried next slice.
            if now_s - self._last_hello_s >= HELLO_INTERVAL_S and self._send(self.hello()):
                self._last_hello_s = now_s
        elif now_s - self._last_sent_s >= HEARTBEAT_INTERVAL_S:
            self._send(step_pb2.Heartbeat(incarnation_id=self.incarnation_id))
        if self.group is not None:
            self.group.keepalive()

    def _beat(self) -> None:
        """The pulse's beat while a step runs (its thread, the socket lock held)."""
        self._send(step_pb2.Heartbeat(incarnation_id=self.incarnation_id))
        notify("WATCHDOG=1")

    def _computing(self, step_id: int) -> contextlib.AbstractContextManager:
        """Around the engine's work on a step: the pulse beats meanwhile (when serving)."""
        return self._pulse.running(step_id) if self._pulse is not None else contextlib.nullcontext()

    def wait_masks(self, step_id: int) -> StepMasks:
        """The MASKS of `step_id` (the engine's wait_masks, called inside a step on this
        thread); MasksNotComing when they do not come in time (see the module docstring)."""
        deadline_s = time.monotonic() + self.masks_timeout_s
        with self._socket_lock:  # the pulse's beat skips meanwhile: this loop beats
            while True:
                now_s = time.monotonic()
                if now_s >= deadline_s:
                    raise MasksNotComing(
                        f"the masks of step {step_id} did not come within "
                        f"{self.masks_timeout_s:g} s"
                    )
                if now_s - self._last_sent_s >= STEP_HEARTBEAT_INTERVAL_S:
                    self._beat()
                slice_s = min(deadline_s - now_s, STEP_HEARTBEAT_INTERVAL_S)
                if not self._socket.poll(max(1, int(slice_s * 1000)), zmq.POLLIN):
                    continue
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
                try:
                    message = wire.decode(frames)
                except wire.FrameError as exc:
                    log.warning("ignored a malformed message: %s", exc)
                    continue
                if not isinstance(message, step_pb2.StepMasks):
                    self._deferred.append(frames)
                    if isinstance(message, step_pb2.Rehello):
                        raise MasksNotComing(
                            f"the scheduler asked for a new hello while step {step_id} "
                            "waited for its masks"
                        )
                elif message.step_id == step_id:
                    return step_codec.decode_masks(message)
                else:
                    log.info("ignored the masks of step %d, not waited for", message.step_id)

    def _group_lost(self) -> bool:
        problem = self.group.lost() if self.group is not None else None
        if problem is not None:
            log.error("the tensor-parallel group is lost (%s); exiting", problem)
        return problem is not None

    def _send(self, message) -> bool:
        try:
            self._socket.send_multipart(wire.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            return False  # no scheduler connected; the timers try again
        self._last_sent_s = time.monotonic()
        return True

    def _handle(self, frames: list[bytes]) -> int | None:
        try:
            message = wire.decode(frames)
        except wire.FrameError as exc:
            log.warning("ignored a malformed message: %s", exc)
            return None
        if isinstance(message, step_pb2.StepPlan):
            return self._run_plans(step_codec.decode_plan(message), frames)
        elif isinstance(message, step_pb2.HelloAck):
            if self._acknowledged:
                # Only an answer to our own hello counts: a stray or forged ack must not
                # reset the sequences of the scheduler we serve, nor stop this worker.
                log.warning("ignored a hello ack that answers no hello")
                return None
            return self._on_ack(message)
        elif isinstance(message, step_pb2.StepMasks):
            # Its step failed before it sampled, or was never run: nothing waits for them.
            log.info("ignored the masks of step %d, not waited for", message.step_id)
        elif isinstance(message, step_pb2.Rehello):
            log.info("scheduler asked for a new hello (%s)", message.reason or "no reason given")
            self._acknowledged = False
            self._forgotten = True
            self._last_hello_s = float("-inf")
        else:
            log.warning("ignored an unexpected %s from the scheduler", type(message).__name__)
        return None

    def _run_plans(self, plan: StepPlan, frames: list[bytes]) -> int | None:
        """Run `plan` and answer it; while its device works, take the next plan if it
        came and may be launched ahead (engine.py), and so on: each result is sent once
        its step is read, in order."""
        launched = self._launch(plan, frames)
        while launched is not None:
            following = None
            ahead = self._plan_ahead(launched)
            if ahead is not None:
                following = self._launch(*ahead)
                self.num_launched_ahead += 1
            try:
                with self._computing(launched.plan.step_id):
                    result = step_codec.encode_result(self.engine.read(launched))
            except Exception as exc:  # the engine reports its own failures; this is a backstop
                step_id = launched.plan.step_id
                result = step_pb2.StepResult(
                    step_id=step_id, step_error=self._crashed(launched.plan, exc)
                )
            if self._group_lost():
                return EXIT_GROUP_LOST  # a partial sum is no result: the scheduler sees a loss
            log.debug(
                "step %d: %d tokens, %d sampled, %.1f ms",
                result.step_id,
                result.num_tokens,
                len(result.token_ids),
                result.total_ms,
            )
            if not self._send(result):
                log.warning("step %d: result dropped, no scheduler connected", result.step_id)
            launched = following
        return None

    def _launch(self, plan: StepPlan, frames: list[bytes]) -> Launched:
        self.num_steps += 1
        if self.group is not None:
            self.group.send_plan(frames)  # as wire.decode just parsed them
        try:
            with self._computing(plan.step_id):
                return self.engine.launch(plan)
        except Exception as exc:  # the engine reports its own failures; this is a backstop
            failure = self._crashed(plan, exc)
            return Launched(plan, time.perf_counter(), after=None, failure=failure)

    def _crashed(self, plan: StepPlan, exc: Exception) -> str:
        """The engine raised where it never should: forget the plan's sequences (the
        scheduler recomputes them) and say why in one line."""
        log.error("step %d: engine crashed: %s", plan.step_id, one_line(exc))
        self.engine.table.forget(plan.named_seq_ids())
        return one_line(exc)

    def _plan_ahead(self, launched: Launched) -> tuple[StepPlan, list[bytes]] | None:
        """The next plan and its frames, if it comes while `launched` is on the device and
        the engine may launch it ahead; any other message received meanwhile is kept for
        the loop, in arrival order. Heartbeats go out as during a step."""
        engine = self.engine
        if not engine.launches_ahead or self.group is not None:
            return None
        # On a CPU the step is done when launched: wait a little for the next plan anyway
        # (--launch-ahead on: the bookkeeping tested end to end; results come later).
        waits_s = 0.0 if engine.facts.device.startswith("cuda") else CPU_AHEAD_WAIT_S
        deadline_s = time.monotonic() + waits_s
        while not self._stop_requested:
            if self._deferred:
                frames = self._deferred[0]
            elif self._socket.poll(AHEAD_POLL_MS, zmq.POLLIN):
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
                self._deferred.append(frames)
            elif launched.done() and time.monotonic() >= deadline_s:
                return None
            else:
                if time.monotonic() - self._last_sent_s >= STEP_HEARTBEAT_INTERVAL_S:
                    self._beat()
                continue
            try:
                message = wire.decode(frames)
            except wire.FrameError:
                return None  # the loop logs and skips it
            if not isinstance(message, step_pb2.StepPlan):
                return None
            plan = step_codec.decode_plan(message)
            if not engine.can_launch_ahead(plan):
                return None
            self._deferred.popleft()
            return plan, frames
        return None

    def _on_ack(self, ack: step_pb2.HelloAck) -> int | None:
        if not ack.accepted:
            log.error(
                "the scheduler refused this worker: %s (our protocol version %d, theirs %d)",
                ack.reason or "no reason given",
                wire.PROTOCOL_VERSION,
                ack.protocol_version,
            )
            return EXIT_REFUSED
        if not ack.scheduler_incarnation_id:
            log.warning("ignored a hello ack without a scheduler incarnation id")
            return None
        if ack.scheduler_incarnation_id != self._scheduler_incarnation_id or self._forgotten:
            if len(self.engine.table):
                log.info("forgetting %d sequences of a past attachment", len(self.engine.table))
            if self.group is not None:
                self.group.send_reset()
            self.engine.reset()
            self._scheduler_incarnation_id = ack.scheduler_incarnation_id
            self._forgotten = False
            log.info("attached to scheduler %s", ack.scheduler_incarnation_id[:8])
        if not self._ready_notified:
            # Ready for systemd: the model is loaded and a scheduler accepted the hello.
            self._ready_notified = notify(
                "READY=1", f"STATUS=serving {ack.scheduler_incarnation_id[:8]}"
            )
        self._acknowledged = True
        return None
