"""Benchmarks: the serving load generator (serving.py) with its ramps (ramp.py) and client processes
(client_processes.py), concurrency sweeps over server configurations
(sweep.py), plots and tables (plots.py), prompt sources (datasets.py); the in-process adaptive-speculation
sweep (adaptive.py), the bandit in a simulated load (bandit_sim.py), and what the scripts in benchmarks/
share (harness.py)."""
