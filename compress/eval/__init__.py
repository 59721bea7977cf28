"""Measurements: perplexity, latency, memory."""
