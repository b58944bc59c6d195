"""The verifier kit: trusted files a verifier sandbox mounts read-only at ``/gyre-verifier`` (``GYRE_VERIFIER``).

Standard library only, run as plain scripts or found through ``PYTHONPATH`` inside the sandbox, never imported
by the trainer: ``sitecustomize.py`` (every Python of the verifier puts the workspace last on ``sys.path``, so
nothing in it shadows the standard library, the test runner or an installed package), ``run_pytest.py`` (the
trusted driver a pytest-based ``tests/test.sh`` execs: it runs pytest in a child process and writes the reward
itself, from a channel the tested code cannot forge without being caught) and ``gyre_pytest_guard.py`` (the
pytest plugin that feeds that channel and watches the test process for tampering). docs/tasks.md says how a
suite uses them; docs/reliability.md which hack each closes.
"""
