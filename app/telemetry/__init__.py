"""What the gateway tells its operator: log lines, Prometheus metrics, trace spans. Imports only
the model."""
