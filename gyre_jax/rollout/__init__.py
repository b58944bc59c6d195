"""Rollouts: task suites, the reference harness, the executor and evaluators."""
