"""Measurements and the gate: perplexity, fidelity, embeddings, latency, the latency model, on-device measurement, and
the checks against a target's budgets."""
