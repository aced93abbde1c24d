"""Leaderless agreement on one plan: a pure protocol core, its runtime, and its contract."""
