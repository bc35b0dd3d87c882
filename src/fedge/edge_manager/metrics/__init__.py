"""What ``manager serve`` shows an ops stack: Prometheus metrics and readiness (issue 27)."""
