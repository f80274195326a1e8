"""Observability: Prometheus metrics, structured logging, the traffic record."""
