"""The gRPC wire schema (fedge.proto and its generated modules); the services and clients
that speak it are transport/grpc."""
