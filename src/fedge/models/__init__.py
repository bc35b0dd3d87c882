"""Model families and their export to ONNX (training side; imports torch)."""
