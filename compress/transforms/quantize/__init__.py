"""Quantization: a typed config per method, the decoder quantizer (a walker visitor), the encoder quantizer, and the
saved quantization every later stage reads."""
