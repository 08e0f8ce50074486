"""Ahead-of-time compilation for TPU topologies on a CPU host, and the parallelism planner."""
