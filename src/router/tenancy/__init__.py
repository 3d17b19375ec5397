"""Who may use the fleet and how much: client keys and tenants, token budgets, overload held at the edge."""
