"""Python client for Pagoda's pagoda.v1.Generation API: `Client` (blocking) and `AsyncClient`."""

from pagoda.client.async_client import AsyncChunkStream, AsyncClient
from pagoda.client.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    PagodaError,
    RequestCancelledError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    error_from_rpc,
)
from pagoda.client.results import (
    Chunk,
    Completion,
    ModelInfo,
    ServerStats,
    TenantStats,
    Timings,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
    WorkerStats,
)
from pagoda.client.sync_client import ChunkStream, Client

__all__ = [
    "AsyncChunkStream",
    "AsyncClient",
    "Chunk",
    "ChunkStream",
    "Client",
    "Completion",
    "DeadlineExceededError",
    "InternalError",
    "InvalidArgumentError",
    "ModelInfo",
    "PagodaError",
    "RequestCancelledError",
    "ResourceExhaustedError",
    "ServerStats",
    "TenantStats",
    "Timings",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
    "WorkerStats",
    "error_from_rpc",
]
