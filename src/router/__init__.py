"""kv-affinity-router: sends every turn of an LLM conversation to the replica that holds its KV cache."""

__version__ = "0.1.0"
