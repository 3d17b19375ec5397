"""Shared memory: the per-host replica table that worker processes and agents share."""
