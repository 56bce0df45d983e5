"""Observability built on the run's event log: report figures and plots, Prometheus metrics, live status."""
