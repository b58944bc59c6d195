"""Start-up of every Python process in a gyre-jax verifier (found first on ``PYTHONPATH``).

The verifier runs with ``PYTHONSAFEPATH=1``: neither the current directory nor a script's directory is put in
front of ``sys.path``. The workspace (``GYRE_WORKSPACE``) is appended instead, *after* the standard library and
site-packages: the agent's modules stay importable by name, but a ``pytest.py``, ``json.py`` or ``xml/`` it left
there can never shadow the runner, the standard library or an installed package.
"""

import os
import sys

_workspace = os.environ.get("GYRE_WORKSPACE", "")
if _workspace and _workspace not in sys.path:
    sys.path.append(_workspace)
del _workspace
