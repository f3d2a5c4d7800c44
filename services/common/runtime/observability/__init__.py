"""What a node tells about itself: structlog lines (logging.py) and Prometheus metrics
(metrics.py)."""
