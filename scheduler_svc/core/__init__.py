"""The scheduling core: pure, no I/O (no grpc, zmq, asyncio, protobuf or torch).

`Scheduler.schedule(now)` plans a step (a StepPlan), `Scheduler.apply(result, now)` takes
the worker's StepResult and returns the step's token outputs (StepOutputs). Service code
imports the core from here; the modules behind it are:
  config         SchedulerConfig (the knobs)
  request        the validated input, a request's state, check_stop (token-id stop rules)
  kv             the block pool and the prefix cache
  waiting_queue  arrival or priority order; preempted requests at the head
  admission      the pure admission policies and each round's window
  tenants        fair share between tenants (weighted tokens served) and their quotas
  running        the running set: running and prefilling sequences, decode round-robin
  preemption     which running request gives up its blocks
  planner        owns the waiting queue, the running set and the pool; plans steps
  plan_builder   the plan under construction: its columns, the blocks it keys, unfeed
  isolation      keeps the suspects of a failed step, planned alone
  scheduler      the facade: add, cancel, schedule, apply, fail_step, stats
  outputs        StepOutputs, RequestOutput, SchedulerStats
The step's plan and result (StepPlan, StepResult, NewSequence), SamplingParams and
WorkerGeometry are pagoda.common.step's, shared with the worker and re-exported here.
"""

from pagoda.common.step import NewSequence, SamplingParams, StepPlan, StepResult, WorkerGeometry
from pagoda.scheduler_svc.core.config import (
    ADMISSION_POLICIES,
    ConfigError,
    SchedulerConfig,
)
from pagoda.scheduler_svc.core.outputs import (
    RequestOutput,
    SchedulerStats,
    StepOutputs,
    Timings,
    TokenLogprob,
    ToolCall,
    Usage,
)
from pagoda.scheduler_svc.core.request import (
    DuplicateRequestError,
    FinishReason,
    QueueFullError,
    RequestTooLargeError,
    ValidRequest,
    ValidStopping,
)
from pagoda.scheduler_svc.core.scheduler import Scheduler
from pagoda.scheduler_svc.core.tenants import TenantQuotaError, TenantStats

__all__ = [
    "ADMISSION_POLICIES",
    "ConfigError",
    "DuplicateRequestError",
    "FinishReason",
    "NewSequence",
    "QueueFullError",
    "RequestOutput",
    "RequestTooLargeError",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepOutputs",
    "StepPlan",
    "StepResult",
    "TenantQuotaError",
    "TenantStats",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "Usage",
    "SamplingParams",
    "ValidRequest",
    "ValidStopping",
    "WorkerGeometry",
]
