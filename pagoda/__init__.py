"""Pagoda: a streaming gRPC service for causal language models.

Every importable part lives under this one name, whatever folder holds it:
`pagoda.protos` (protos/), `pagoda.common` (code both processes share), `pagoda.scheduler_svc`
(scheduler_svc/), `pagoda.gpu_worker` (gpu_worker/), `pagoda.client` (client/) and
`pagoda.openai_front` (openai_front/, the OpenAI-compatible HTTP front).
"""
