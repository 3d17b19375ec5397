"""KV-cache events from the engines: their wire, what each replica holds, and requests in the engine's own tokens."""
