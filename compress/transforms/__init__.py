"""Model transforms: the shared block walker and what runs through it (quantize, sparsify, prune, distill)."""
