"""Serving: the JetStream-style engine, sampling, and the continuous-batching loop of a cell."""
