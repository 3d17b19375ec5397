"""`router-bench`: benchmarks that measure the router side by side (speed is measured here, never asserted in tests)."""
