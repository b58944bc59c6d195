"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""

from pathlib import Path


def text(name):
    """The file's text with trailing whitespace of each line and of the file removed."""
    return "\n".join(line.rstrip() for line in Path(name).read_text().rstrip().splitlines())


def test_task():
    assert text("port.txt") == "8080"
