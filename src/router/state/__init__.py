"""Routing state kept past a process: a file, Redis, and the tables the worker processes of a host share."""
