"""The device side: config, model swap, ONNX inference, durable outbox, labels.

Nothing here imports torch: the inference path is ONNX Runtime, NumPy and Pillow.
"""
