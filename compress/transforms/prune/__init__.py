"""Structured pruning: choosing which attention heads decoders and encoders keep."""
