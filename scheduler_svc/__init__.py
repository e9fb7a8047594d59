"""Pagoda's scheduler: the gRPC API, request queue, KV block ownership and the step loop.

Never imports torch (tests/unit/test_no_torch.py checks it).
"""
