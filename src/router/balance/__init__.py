"""Balance and elasticity: overheat rebalancing, cache warm-up, gentle scale-out and drain."""
