"""Pagoda's worker: executes the scheduler's step plans over a paged KV pool.

Importing this package loads no torch; the engine modules do.
"""
