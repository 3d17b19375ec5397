"""`router-emulator`: OpenAI-compatible replicas with a paged prefix cache and continuous batching, no GPU needed."""
