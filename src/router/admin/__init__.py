"""Operator-facing surfaces of the router: the admin REST API."""
