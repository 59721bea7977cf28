"""The portable Q/DQ ONNX: decoder and encoder export, the Q/DQ rewrite, graph files, ONNX Runtime sessions."""
