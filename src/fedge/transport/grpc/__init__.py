"""fedge's gRPC services and clients (the adapters); the wire schema is protocols/grpc."""
