"""Benchmarks that print figures side by side with a baseline from the same run."""
