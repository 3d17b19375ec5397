"""`router-serve`: the aiohttp application that routes and forwards requests to replicas."""
