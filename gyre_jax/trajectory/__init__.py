"""Trajectory processing: TITO records -> trees -> J_max branches with de-duplicated targets -> packed micro-batches.

``reader`` (strict record files), ``branches`` (records -> labelled branches), ``select`` (J_max, priority,
de-duplication, weights), ``tree`` (prefix-tree layout in row-sized chunks), ``packing`` (fixed-shape
micro-batches), ``batch`` (``MicroBatch`` and its attention mask), ``queue`` (finished executions to train
on), ``pipeline`` (the Grain chain and ``TrajectoryPipeline``), ``synthetic`` (long-horizon traces).
See docs/trajectory.md.
"""
