"""What leaves the station: publisher, outbox sender, statements, telemetry, gRPC polling."""
