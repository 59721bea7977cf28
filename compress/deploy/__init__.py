"""Deployment formats: what leaves compress for other tools and runtimes."""
