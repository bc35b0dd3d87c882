"""Scoring on the station: ONNX Runtime, image decoding, the scoring path and its entrances."""
