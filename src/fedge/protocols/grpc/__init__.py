"""gRPC transport for fedge: resumable model download and streamed report upload."""
