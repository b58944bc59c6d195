"""requirements.txt and pyproject.toml must not drift apart."""

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower()


def test_requirements_match_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_name(r): r for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    listed = {
        _name(line): line
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert declared == listed
