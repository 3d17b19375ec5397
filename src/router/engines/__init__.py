"""The engines as the router meets them: reached, found, handed off between, and read (KV events, tokens)."""
