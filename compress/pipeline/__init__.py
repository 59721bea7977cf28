"""Runs: stages, plans, execution and resume, re-gating, and the device commands."""
