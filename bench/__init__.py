"""Benchmarks; run each as a module from the repo root: `.venv/bin/python -m bench.<name>`."""
