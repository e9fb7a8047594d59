"""The scheduler's end of the step protocol: a ZeroMQ ROUTER that workers connect to.

Owns the conversation of protos/step.proto (hello, ack, heartbeats, rehello, goodbye)
and turns it into three facts for the step loop: a worker attached (with its hello) and a
worker is gone, reported to the WorkerEvents given to start(), and the result of a step,
the future start_step() returns. Called only from the event loop.

One worker by default: a new one replaces the one attached. With max_workers above 1
(data parallel, one lane each in scheduler_svc/front.py), up to that many attach side by side, each by its
own routing identity, all serving the same model; a detach then names its worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagoda.common import curve, step_codec, transport, wire
from pagoda.common.settings import insecure_tcp_warning
from pagoda.protos import step_pb2
from pagoda.scheduler_svc.log_budget import LogBudget

log = logging.getLogger("pagoda.worker_link")

# A worker sends a heartbeat every second while idle; this much silence between
# steps means it is gone.
HEARTBEAT_TIMEOUT_S = 5.0
# Messages read, at most, before a worker found gone is dropped (see _drop_when_read): the
# ROUTER reads its peers in turn, so a gone worker's last few (a result, a goodbye) come
# within a few reads per attached worker.
GONE_READ_BUDGET = 256
# Where libzmq asks who may connect (ZAP, ZeroMQ RFC 27), within this process's context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    identity: bytes  # the worker's ZeroMQ routing id
    hello: step_pb2.Hello
    fd: int | None = None  # our end of its connection, to recognise its disconnect


# A plan in flight and the future its result completes.
_Pending = tuple[step_pb2.StepPlan, "asyncio.Future[step_pb2.StepResult]"]


@dataclass(slots=True)
class _Peer:
    """An attached worker: when it was last heard, and its plans in flight (two with
    overlapped steps) by step id (each worker's scheduler numbers its own steps)."""

    info: WorkerInfo
    last_seen_s: float
    pending: dict[int, _Pending]

    def silent_s(self) -> float:
        """Seconds since it last sent anything."""
        return time.monotonic() - self.last_seen_s


class WorkerLost(Exception):
    """The worker went away (timeout, restart, unreachable) while a step was in flight.

    `suspect`: whether the step's requests may have caused it. A crash, a hang or a closed
    connection may be a poison request's doing; a worker dropped for a message that breaks
    the protocol, or a plan that was never sent, says nothing about the requests.
    """

    def __init__(self, reason: str, *, suspect: bool = True) -> None:
        super().__init__(reason)
        self.suspect = suspect


class WorkerEvents(Protocol):
    """Who hears of attaches and detaches (the serving front); called on the event loop."""

    def worker_attached(self, info: WorkerInfo) -> None: ...

    def worker_detached(self, reason: str, *, suspect: bool = True) -> None: ...


class WorkerLink:
    def __init__(
        self,
        endpoint: str,
        curve_keys: curve.KeyPair | None = None,
        authorized_worker_keys: frozenset[bytes] = frozenset(),
        max_workers: int = 1,
    ) -> None:
        """With `curve_keys`, only CurveZMQ workers whose public key (Z85) is in
        `authorized_worker_keys` can connect; traffic is encrypted. With `max_workers`
        above 1, that many workers may attach at once (a later one is refused)."""
        self.endpoint = endpoint
        self._curve_keys = curve_keys
        self._authorized_worker_keys = authorized_worker_keys
        self.scheduler_incarnation_id = uuid.uuid4().hex
        self._events: WorkerEvents | None = None  # given to start()
        self._context = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._zap: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._max_workers = max_workers
        self._peers: dict[bytes, _Peer] = {}  # by routing identity, in attach order
        # Workers found gone (a send failed, or their connection closed) while messages
        # were still waiting to be read: dropped once those are read (_drop_when_read).
        self._gone: dict[bytes, str] = {}
        self._reads_left_for_gone = 0  # then they are dropped even if more is waiting
        self._tasks: list[asyncio.Task] = []
        self._log_budget = LogBudget()

    @property
    def worker(self) -> WorkerInfo | None:
        """The first worker attached (the only one with max_workers 1), or None."""
        return next((peer.info for peer in self._peers.values()), None)

    @property
    def workers(self) -> list[WorkerInfo]:
        return [peer.info for peer in self._peers.values()]

    async def start(self, events: WorkerEvents) -> None:
        """Bind and serve; from now on attaches and detaches are reported to `events`."""
        self._events = events
        if self.endpoint.startswith("ipc://"):
            socket_path = Path(self.endpoint.removeprefix("ipc://"))
            transport.prepare_ipc_directory(self.endpoint)  # UnsafeSocketDirectory
            # A socket file left by a crashed scheduler would make bind fail.
            if socket_path.exists():
                socket_path.unlink()
        socket = self._context.socket(zmq.ROUTER)
        transport.configure(socket)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if self._curve_keys is not None:
            # The ZAP handler must be bound before the first peer's handshake.
            self._zap = self._context.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(ZAP_ENDPOINT)
            self._tasks.append(asyncio.create_task(self._answer_zap(), name="worker-link-zap"))
            curve.make_server(socket, self._curve_keys)
        warning = insecure_tcp_warning(self.endpoint, curve=self._curve_keys is not None)
        if warning is not None:
            log.warning("%s", warning)
        socket.bind(self.endpoint)
        if self.endpoint.startswith("ipc://"):
            os.chmod(self.endpoint.removeprefix("ipc://"), 0o600)
        self._socket = socket
        # A worker process that dies closes its connection, and one that hangs or whose
        # host vanished has it closed by the transport heartbeats (protos/transport.py):
        # noticed then, not only when a step's result times out.
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._tasks += [
            asyncio.create_task(self._watch_disconnects(), name="worker-link-disconnects"),
            asyncio.create_task(self._receive_forever(), name="worker-link-receive"),
            asyncio.create_task(self._watch_heartbeats(), name="worker-link-watchdog"),
        ]
        log.info(
            "waiting for a worker on %s%s",
            self.endpoint,
            f" (CurveZMQ, {len(self._authorized_worker_keys)} authorized worker keys)"
            if self._curve_keys
            else "",
        )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None and self._monitor is not None:
            self._socket.disable_monitor()
        for socket in (self._monitor, self._socket, self._zap):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()

    def start_step(
        self, plan: step_pb2.StepPlan, timeout_s: float, identity: bytes | None = None
    ) -> asyncio.Future[step_pb2.StepResult]:
        """Send one plan to the worker of `identity` (None: the first attached) now, before
        returning, and give the future of its result; it fails with WorkerLost if that
        worker does not answer. Another plan may be in flight (overlapped steps): the
        worker answers in order, and `timeout_s` counts from this send, so it covers the
        step before too. It is a bound on silence, not on the step: a worker heard from
        since (a result of the step before, or a heartbeat it sends while a long step
        runs, see gpu_worker/step_pulse.py) has `timeout_s` from then.

        The send is not left to a task: the worker has its next plan before any stream
        writer runs, and the result wakes its awaiter directly (no task between)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[step_pb2.StepResult] = loop.create_future()
        peer = self._peer(identity)
        if peer is None or self._socket is None:
            future.set_exception(WorkerLost("no worker attached", suspect=False))
            return future
        worker, pending, step_id = peer.info, peer.pending, plan.step_id

        def lose(reason: str) -> None:
            self._drop_worker_if(worker.identity, reason)  # fails this future too
            if not future.done():
                future.set_exception(WorkerLost(reason))

        def expire() -> None:
            nonlocal timer
            if future.done():
                return
            silent_s = peer.silent_s()
            if silent_s < timeout_s:  # it spoke after the send: still at work
                timer = loop.call_later(timeout_s - silent_s, expire)
                return
            lose(f"no result for step {step_id} and no word for {timeout_s:g} s")

        def sent(send: asyncio.Future) -> None:
            if send.cancelled():
                lose("the plan was never sent")
            elif send.exception() is not None:
                self._drop_when_read(
                    worker.identity, f"cannot reach the worker ({send.exception()})"
                )

        def settled(_: asyncio.Future) -> None:
            timer.cancel()
            if pending.get(step_id, (None, None))[1] is future:
                del pending[step_id]

        pending[step_id] = (plan, future)
        timer = loop.call_later(timeout_s, expire)
        future.add_done_callback(settled)
        send = self._send(worker.identity, plan)
        if send.done():  # the usual case: ZeroMQ took it at once
            sent(send)
        else:
            send.add_done_callback(sent)
        return future

    def send_masks(self, masks: step_pb2.StepMasks, identity: bytes | None = None) -> None:
        """Send the masks that follow a plan sent by start_step (StepPlan.masks_follow) to
        the worker of `identity` (None: the first attached), now. Nothing when it is gone:
        its step is lost anyway, and a worker that did not get them fails that step after
        its wait (gpu_worker/server.py) rather than hang."""
        peer = self._peer(identity)
        if peer is not None and self._socket is not None:
            self._send(peer.info.identity, masks)

    async def run_step(
        self, plan: step_pb2.StepPlan, timeout_s: float, identity: bytes | None = None
    ) -> step_pb2.StepResult:
        """start_step, awaited."""
        return await self.start_step(plan, timeout_s, identity)

    def heard_within(self, seconds: float, identity: bytes | None = None) -> bool:
        """Whether the worker of `identity` (None: the first attached) sent anything in
        the last `seconds`."""
        peer = self._peer(identity)
        return peer is not None and peer.silent_s() <= seconds

    def _peer(self, identity: bytes | None) -> _Peer | None:
        if identity is None:
            return next(iter(self._peers.values()), None)
        return self._peers.get(identity)

    async def _answer_zap(self) -> None:
        """Admit a CURVE peer only by an authorized public key; log every refusal."""
        assert self._zap is not None
        while True:
            request = await self._zap.recv_multipart()
            version, request_id = request[:2] if len(request) >= 2 else (b"1.0", b"")
            mechanism, credentials = request[5:6], request[6:7]
            key = curve.z85_of(credentials[0]) if mechanism == [b"CURVE"] and credentials else None
            if key is not None and key in self._authorized_worker_keys:
                status, text = b"200", b"OK"
            else:
                status, text = b"400", b"this key is not authorized"
                address = request[3].decode(errors="replace") if len(request) > 3 else "?"
                self._warn(
                    "zap",
                    "refused a ZeroMQ peer from %s: its CURVE public key %s is not in the "
                    "authorized worker keys",
                    address or "?",
                    key.decode() if key else "(none)",
                )
            await self._zap.send_multipart([version, request_id, status, text, b"", b""])

    def _send(self, identity: bytes, message) -> asyncio.Future:
        """Hand one message to ZeroMQ now; the future completes once it is sent."""
        assert self._socket is not None
        return self._socket.send_multipart([identity, *wire.encode(message)])

    async def _receive_forever(self) -> None:
        """Read, check and dispatch messages until closed. Nothing a peer sends ends this
        task: a bad message is logged, and drops the worker if it came from the worker."""
        assert self._socket is not None
        socket = self._socket
        while True:
            # Frame by frame, keeping at most the two of the protocol: a peer's thousand
            # extra frames are counted and released, never copied.
            frame = await socket.recv(copy=False)
            identity, body, num_extra = frame.bytes, [], 0
            while frame.more:
                frame = await socket.recv(copy=False)
                if len(body) < 2:
                    body.append(frame)
                else:
                    num_extra += 1
            try:
                if num_extra:
                    raise wire.FrameError(f"expected 2 frames (kind, body), got {2 + num_extra}")
                message = wire.decode([part.bytes for part in body])
                await self._dispatch(identity, message, _source_fd(frame))
            except wire.FrameError as exc:
                self._refuse(identity, f"a malformed message: {exc}")
            except zmq.ZMQError as exc:
                self._warn("answer", "could not answer the worker %s: %s", identity.hex(), exc)
            except Exception:
                self._warn(
                    "unhandled",
                    "dropped a message from %s that could not be handled",
                    identity.hex(),
                    exc_info=True,
                )
                self._drop_worker_if(identity, "a message that could not be handled", suspect=False)
            if self._gone:
                self._reads_left_for_gone -= 1
                if self._reads_left_for_gone <= 0 or not socket.get(zmq.EVENTS) & zmq.POLLIN:
                    self._drop_gone()

    def _refuse(self, identity: bytes, what: str) -> None:
        """One log line for a bad message; the worker is dropped if it sent it (it may say
        hello again), a stranger's message is only logged."""
        if identity in self._peers:
            self._drop_worker(identity, f"it sent {what}", suspect=False)
        else:
            self._warn("stranger", "ignored %s from %s", what, identity.hex())

    def _warn(self, kind: str, message: str, *args, exc_info: bool = False) -> None:
        """A warning a stranger can cause, within the log budget of its kind."""
        num_left_out = self._log_budget.take(kind, time.monotonic())
        if num_left_out is None:
            return
        if num_left_out:
            message += " (%d more like it left out of the log)"
            args = (*args, num_left_out)
        log.warning(message, *args, exc_info=exc_info)

    def _drop_worker_if(self, identity: bytes, reason: str, *, suspect: bool = True) -> None:
        if identity in self._peers:
            self._drop_worker(identity, reason, suspect=suspect)

    async def _watch_disconnects(self) -> None:
        assert self._monitor is not None
        while True:
            await self._monitor.poll()  # events are only taken by _take_disconnects
            self._take_disconnects()

    def _take_disconnects(self) -> None:
        """Act on every disconnect event queued so far, oldest first.

        Also called before a hello attaches a worker: a new connection may get the fd of
        one that just closed, whose event is then already queued (libzmq emits it before
        closing the fd), and that event must drop the old worker, not the new one.
        """
        assert self._monitor is not None
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK).result()
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            for peer in list(self._peers.values()):
                if peer.info.fd is not None and event["value"] == peer.info.fd:
                    self._drop_when_read(peer.info.identity, "its connection closed")

    def _drop_when_read(self, identity: bytes, reason: str) -> None:
        """Drop a worker that is gone, but only after every message it sent before it went
        has been read: its last one may be a goodbye, which clears its requests of
        suspicion, or a result. Drops it now when nothing is waiting to be read."""
        assert self._socket is not None
        if identity not in self._peers:
            return
        if self._socket.get(zmq.EVENTS) & zmq.POLLIN:
            # _receive_forever drops it once nothing waits, or after GONE_READ_BUDGET
            # messages: other workers' steady traffic must not keep it attached.
            if not self._gone:
                self._reads_left_for_gone = GONE_READ_BUDGET
            self._gone.setdefault(identity, reason)
        else:
            self._drop_worker(identity, reason)

    def _drop_gone(self) -> None:
        gone, self._gone = self._gone, {}
        for identity, reason in gone.items():
            self._drop_worker_if(identity, reason)

    async def _dispatch(self, identity: bytes, message, fd: int | None) -> None:
        if isinstance(message, step_pb2.Hello):
            await self._on_hello(identity, message, fd)
            return
        peer = self._peers.get(identity)
        if peer is None:
            # A worker we have not acknowledged (we restarted, or it is a stray):
            # ask it to introduce itself.
            if isinstance(message, step_pb2.Heartbeat | step_pb2.StepResult):
                await self._send(identity, step_pb2.Rehello(reason="unknown worker"))
            return
        current = peer.info
        peer.last_seen_s = time.monotonic()
        if isinstance(message, step_pb2.Goodbye):
            if message.incarnation_id != current.hello.incarnation_id:
                log.warning("ignored a goodbye that names another worker")
                return
            # It stopped on purpose after answering the plan it ran: the plans it left
            # unstarted are recomputed, their requests not suspected.
            reason = " ".join(message.reason[:64].split()) or "no reason given"
            self._drop_worker(identity, f"it stopped ({reason})", suspect=False)
            return
        if isinstance(message, step_pb2.StepResult):
            pending = peer.pending.get(message.step_id)
            if pending is None or pending[1].done():
                log.warning("ignored a result for step %d that is not in flight", message.step_id)
                return
            plan, future = pending
            problem = step_codec.result_problem(plan, message, current.hello.vocab_size)
            if problem is not None:
                self._refuse(identity, f"a result for step {plan.step_id} that does not match "
                             f"its plan: {problem}")  # fmt: skip
                return
            future.set_result(message)

    async def _on_hello(self, identity: bytes, hello: step_pb2.Hello, fd: int | None) -> None:
        self._take_disconnects()
        reason = hello_problem(hello)
        if reason is not None:
            log.error("refused worker %s: %s", hello.incarnation_id[:128] or identity.hex(), reason)
            await self._send(identity, step_pb2.HelloAck(accepted=False, reason=reason))
            return
        peer = self._peers.get(identity)
        if peer is None or peer.info.hello.incarnation_id != hello.incarnation_id:
            # The same connection with a new incarnation, or (one worker at a time) a new
            # worker, replaces the one attached.
            replaced = peer if peer is not None or self._max_workers > 1 else self._peer(None)
            others = [p.info for p in self._peers.values() if p is not replaced]
            reason = _fleet_problem(hello, others, self._max_workers)
            if reason is not None:
                log.error("refused worker %s: %s", hello.incarnation_id, reason)
                await self._send(identity, step_pb2.HelloAck(accepted=False, reason=reason))
                return
            if replaced is not None:
                self._drop_worker(
                    replaced.info.identity,
                    f"worker {hello.incarnation_id} replaced {replaced.info.hello.incarnation_id}",
                )
            peer = _Peer(WorkerInfo(identity=identity, hello=hello, fd=fd), 0.0, {})
            self._peers[identity] = peer
            log.info(
                "worker %s attached: model %s on %s, %d KV blocks of %d tokens%s",
                hello.incarnation_id,
                hello.model_id,
                hello.device,
                hello.num_kv_blocks,
                hello.block_size,
                f" ({len(self._peers)} of at most {self._max_workers} workers)"
                if self._max_workers > 1
                else "",
            )
            assert self._events is not None
            self._events.worker_attached(peer.info)
        peer.last_seen_s = time.monotonic()
        await self._send(
            identity,
            step_pb2.HelloAck(
                accepted=True,
                protocol_version=wire.PROTOCOL_VERSION,
                scheduler_incarnation_id=self.scheduler_incarnation_id,
            ),
        )

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S / 5)
            for peer in list(self._peers.values()):
                silent_s = peer.silent_s()
                if not peer.pending and silent_s > HEARTBEAT_TIMEOUT_S:
                    self._drop_worker(peer.info.identity, f"no heartbeat for {silent_s:.1f} s")

    def _drop_worker(self, identity: bytes, reason: str, *, suspect: bool = True) -> None:
        self._gone.pop(identity, None)
        peer = self._peers.pop(identity, None)
        if peer is None:
            return
        log.warning("worker %s lost: %s", peer.info.hello.incarnation_id, reason)
        for _, future in peer.pending.values():
            if not future.done():
                future.set_exception(WorkerLost(reason, suspect=suspect))
        assert self._events is not None
        if self._max_workers == 1:
            self._events.worker_detached(reason, suspect=suspect)
        else:  # the lanes need to know whose
            self._events.worker_detached(reason, identity, suspect=suspect)


def _source_fd(frame: zmq.Frame) -> int | None:
    """The file descriptor of the connection a message came in on (None if unknown)."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None


# Bounds on a hello's geometry: generous for any real model and pool (a 16M-token
# vocabulary, 2M blocks of up to 1024 tokens), small enough that sizing the block pool and
# the vocabulary checks after it cost bounded memory; strings are logged and served to
# every GetModelInfo caller.
MAX_HELLO_VALUES: dict[str, int] = {
    "vocab_size": 1 << 24,
    "max_context_tokens": 1 << 24,
    "block_size": 1024,
    "num_kv_blocks": 1 << 21,
}
MAX_HELLO_STRING_BYTES: dict[str, int] = {
    "incarnation_id": 128,
    "model_id": 256,
    "device": 64,
    "dtype": 32,
    "quantization": 32,
    "numerics": 1024,
}
MAX_EOS_TOKEN_IDS = 256


def _fleet_problem(hello: step_pb2.Hello, others: list[WorkerInfo], max_workers: int) -> str | None:
    """Why a worker cannot join the `others` attached (a sentence for both logs), or None:
    there is no room, or it serves another model than they do."""
    if len(others) >= max_workers:
        return (
            f"this scheduler already serves {len(others)} workers, its --max-workers; stop "
            "one or raise the limit"
        )
    for other in others:
        mine = (hello.model_id, hello.vocab_size, sorted(hello.eos_token_ids))
        theirs = (other.hello.model_id, other.hello.vocab_size, sorted(other.hello.eos_token_ids))
        if mine != theirs:
            return (
                f"it serves model {hello.model_id!r} (vocabulary {hello.vocab_size}, eos "
                f"{mine[2]}) but worker {other.hello.incarnation_id} serves "
                f"{other.hello.model_id!r} (vocabulary {other.hello.vocab_size}, eos "
                f"{theirs[2]}): all workers of one scheduler serve the same model"
            )
    return None


def hello_problem(hello: step_pb2.Hello) -> str | None:
    """Why a hello cannot be accepted (a sentence for both logs), or None."""
    if hello.protocol_version != wire.PROTOCOL_VERSION:
        return (
            f"protocol version {hello.protocol_version} is not supported; this scheduler "
            f"speaks version {wire.PROTOCOL_VERSION}"
        )
    if not hello.incarnation_id:
        return "the hello carries no incarnation id"
    for name, limit in MAX_HELLO_STRING_BYTES.items():
        if len(getattr(hello, name).encode()) > limit:
            return f"the hello's {name} is longer than {limit} bytes"
    for name, limit in MAX_HELLO_VALUES.items():
        value = getattr(hello, name)
        if value == 0:
            return f"the hello's {name} is 0"
        if value > limit:
            return f"the hello's {name} {value} is beyond the bound of {limit}"
    if len(hello.eos_token_ids) > MAX_EOS_TOKEN_IDS:
        return f"the hello names more than {MAX_EOS_TOKEN_IDS} eos_token_ids"
    if any(token_id >= hello.vocab_size for token_id in hello.eos_token_ids):
        return "the hello's eos_token_ids fall outside its vocabulary"
    return None
