"""Replica health: engine signals, the score they make, and the state machine that acts on it."""
