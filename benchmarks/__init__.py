"""Pagoda's benchmarks: the suite behind `make bench`, the scheduler core and one worker step.

Tools, not product: run from the repository root (`python -m benchmarks.suite`); nothing under
pagoda.* imports them.
"""
