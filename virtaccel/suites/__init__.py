"""Scenario suites run against a whole machine (tenants, later hostile and explore)."""
