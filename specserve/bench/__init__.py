"""Serving benchmark: load generator (serving.py), concurrency sweeps over server configurations
(sweep.py), plots and tables (plots.py), prompt sources (datasets.py)."""
