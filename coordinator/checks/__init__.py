"""Checking the nodes' answers: audits and bans (audit.py), recomputing an answer on the coordinator's own
slabs (recompute.py), the bound for another numerics class (tolerance.py), two holders compared (twins.py)."""
