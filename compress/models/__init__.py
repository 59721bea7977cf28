"""Models: where they come from, how each decoder family is wired, loading them safely, and surgery on them."""
