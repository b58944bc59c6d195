"""Trajectory processing: TITO records -> branches -> packed micro-batches."""
