"""The math that stages share: quantizers, SmoothQuant, AWQ, GPTQ, calibration loops."""
