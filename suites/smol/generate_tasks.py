"""Writes the task directories of the `smol` suite (Harbor format, docs/tasks.md): one-file shell and Python
tasks sized for a 135M chat model (SmolLM2-135M-Instruct), each with hidden pytest tests, an oracle and a
declared split (task.toml ``[metadata] split``: "train" or "heldout").

The task directories are committed; this script is where they are defined. Edit TASKS here, then run
``python suites/smol/generate_tasks.py && ruff format suites/smol`` (it rewrites every task directory it lists and
removes none), and check
the suite: ``python -m gyre_jax.rollout.check_suite suites/smol --sandbox bwrap``.

Each instruction states the goal and then the command that reaches it (``Run: <the oracle's command>``): the
model is a 135M chat model, which without the command almost never writes a working one (docs/tasks.md, "The
`smol` suite"); with it, it often still does not (it comments the command out, adds flags, renames files,
wraps it in prose), which is the behaviour RL has to fix. Tasks come in families of three of the same kind and difficulty (two for training, one held out), so the
held-out split measures transfer to unseen instances of the kinds trained on. Each task has ONE hidden test
(the reward is 0 or 1): an untouched workspace fails it, the oracle passes it.

No task sets an ``[agent] timeout_sec``: an execution's wall time is almost all model serving, which depends on
the hardware and its load (seconds on a GPU, many minutes on a shared 2-core CPU), so the run's
``rollout.timeout_s`` is the limit (a task's own limit would override it).
"""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent

DOCKERFILE = """\
FROM python:3.11-slim
RUN pip install --no-cache-dir pytest==8.3.4
WORKDIR /app
COPY . /app
"""

# The verifier: suites/pyrepo's (gyre-jax's trusted driver runs the hidden tests; reward = fraction of the
# tests in expected_tests.txt that passed; pytest missing is "could not run", never a 0).
TEST_SH = r"""#!/usr/bin/env bash
# Harbor verifier: runs the hidden tests against the final workspace; reward = fraction of the tests listed in
# expected_tests.txt that passed. gyre-jax's trusted driver (its verifier kit, GYRE_VERIFIER) runs pytest in a
# child process and writes the reward itself once everything that child started is dead; pytest missing is
# "could not run" (unavailable.txt: the execution is excluded), never a 0. Paths are Harbor's (/app, /tests,
# /logs) inside a sandbox; GYRE_* give them when run without one.
set -u
TESTS="${GYRE_TESTS:-/tests}"
LOGS="${GYRE_LOGS:-/logs}"
if [ -z "${GYRE_VERIFIER:-}" ]; then
  mkdir -p "$LOGS/verifier"
  echo "this verifier needs gyre-jax's verifier kit (GYRE_VERIFIER is not set)" | tee "$LOGS/verifier/unavailable.txt" >&2
  exit 3
fi
cd "${GYRE_WORKSPACE:-/app}" || exit 3
exec python3 -I "$GYRE_VERIFIER/run_pytest.py" --tests "$TESTS" --workspace "$PWD" --logs "$LOGS/verifier" \
  --expected "$TESTS/expected_tests.txt"
"""

EXPECTED = (
    "# the tests the verifier must run (check_suite --write-expected, from the oracle's run)\ntest_task.py::test_task\n"
)

TEST_HELPER = '''

def text(name):
    """The file's text with trailing whitespace of each line and of the file removed."""
    return "\\n".join(line.rstrip() for line in Path(name).read_text().rstrip().splitlines())
'''


def test_file(body: str) -> str:
    """The hidden test module: the imports ``body`` uses, the ``text`` helper, ``def test_task(): body``."""
    imports = [f"import {m}" for m in ("os", "subprocess", "sys") if f"{m}." in body]
    uses_path = "Path(" in body or "text(" in body
    head = '"""Hidden test of this task (run by tests/test.sh in the final workspace, the current directory)."""\n\n'
    head += "\n".join(imports + (["from pathlib import Path"] if uses_path else [])) + "\n"
    helper = TEST_HELPER if "text(" in body else ""
    return head + helper + "\n\ndef test_task():\n    " + body + "\n"


@dataclass
class T:
    """One task: its name, family, split, instruction, starting files, the body of its test and its oracle."""

    name: str
    family: str
    split: str
    instruction: str
    test: str  # the body of ``def test_task():``
    solve: str  # bash lines run in the workspace
    files: dict[str, str] = field(default_factory=dict)
    difficulty: str = "easy"


def write_text(name: str, fam: str, split: str, path: str, content: str) -> T:
    return T(name, fam, split, f"Create a file named {path} that contains the text: {content}",
             f"assert text({path!r}) == {content!r}", f"echo {content!r} > {path}")  # fmt: skip


def make_dir(name: str, split: str, path: str, phrase: str) -> T:
    return T(name, "mkdir", split, phrase.format(path=path), f"assert Path({path!r}).is_dir()", f"mkdir -p {path}")


def rename(name: str, split: str, src: str, dst: str, content: str, phrase: str, extra: dict | None = None) -> T:
    return T(name, "rename", split, phrase.format(src=src, dst=dst),
             f"assert not Path({src!r}).exists()\n    assert text({dst!r}) == {content!r}",
             f"mv {src} {dst}", {src: content + "\n", **(extra or {})})  # fmt: skip


def copy(name: str, split: str, src: str, dst: str, content: str, phrase: str, extra: dict | None = None) -> T:
    return T(name, "copy", split, phrase.format(src=src, dst=dst),
             f"assert text({src!r}) == {content!r}\n    assert text({dst!r}) == {content!r}",
             f"cp {src} {dst}", {src: content + "\n", **(extra or {})})  # fmt: skip


def append(name: str, split: str, path: str, lines: list[str], new: str) -> T:
    body = "\n".join(lines)
    return T(name, "append", split, f"Add the line {new} to the end of the file {path}.",
             f"assert text({path!r}).splitlines() == {[*lines, new]!r}",
             f"echo {new!r} >> {path}", {path: body + "\n"})  # fmt: skip


def chmod(name: str, split: str, path: str, word: str) -> T:
    script = f"#!/bin/sh\necho {word}\n"
    return T(name, "chmod", split, f"Make the script {path} executable.",
             f"assert os.access({path!r}, os.X_OK)\n"
             f"    assert subprocess.run(['./{path}'], capture_output=True, text=True).stdout.strip() == {word!r}",
             f"chmod +x {path}", {path: script})  # fmt: skip


def py_fix(name: str, split: str, module: str, func: str, wrong: str, right: str, args: tuple, want) -> T:
    src = f"def {func}(a, b):\n    return {wrong}\n"
    call = f"{func}({', '.join(map(repr, args))})"
    return T(name, "pyfix", split,
             f"The function {func} in {module}.py is wrong: it returns {wrong} but it should return {right}. Fix it.",
             f"sys.path.insert(0, os.getcwd())\n    import {module}\n\n    assert {module}.{call} == {want!r}\n"
             f"    assert {module}.{func}(10, 4) == {eval(right, {'a': 10, 'b': 4})!r}",
             f"sed -i 's/return {wrong}/return {right}/' {module}.py", {f"{module}.py": src})  # fmt: skip


def tasks() -> list[T]:
    out = [
        write_text("write-hello", "write", "train", "hello.txt", "hello world"),
        write_text("write-greeting", "write", "train", "greeting.txt", "good morning"),
        write_text("write-motto", "write", "heldout", "motto.txt", "keep it simple"),
        make_dir("mkdir-build", "train", "build", "Create a directory named {path}."),
        make_dir("mkdir-logs", "train", "logs", "Create a new folder called {path}."),
        make_dir("mkdir-output", "heldout", "output", "Make a directory named {path}."),
        rename("rename-draft", "train", "draft.txt", "final.txt", "version one", "Rename the file {src} to {dst}."),
        rename(
            "move-notes",
            "train",
            "notes.txt",
            "archive/notes.txt",
            "buy milk",
            "Move the file notes.txt into the directory archive.",
            {"archive/.keep": ""},
        ),
        rename("rename-old-name", "heldout", "old_name.txt", "new_name.txt", "some data", "Rename {src} to {dst}."),
        copy(
            "copy-config",
            "train",
            "config.ini",
            "config.bak",
            "[main]\ndebug = false",
            "Make a copy of {src} named {dst}.",
        ),
        copy(
            "copy-report",
            "train",
            "report.txt",
            "backup/report.txt",
            "sales are up",
            "Copy the file report.txt into the directory backup.",
            {"backup/.keep": ""},
        ),
        copy(
            "copy-data",
            "heldout",
            "data.csv",
            "data_copy.csv",
            "id,value\n1,10\n2,20",
            "Copy {src} to a new file called {dst}.",
        ),
        T(
            "delete-junk",
            "delete",
            "train",
            "Delete the file junk.tmp.",
            "assert not Path('junk.tmp').exists()\n    assert text('keep.txt') == 'important'",
            "rm junk.tmp",
            {"junk.tmp": "garbage\n", "keep.txt": "important\n"},
        ),
        T(
            "delete-cache-dir",
            "delete",
            "train",
            "Remove the directory cache and everything inside it.",
            "assert not Path('cache').exists()\n    assert text('main.txt') == 'keep me'",
            "rm -rf cache",
            {"cache/a.bin": "1\n", "cache/b.bin": "2\n", "main.txt": "keep me\n"},
        ),
        T(
            "delete-old-log",
            "delete",
            "heldout",
            "Delete the file old.log.",
            "assert not Path('old.log').exists()\n    assert text('new.log') == 'today'",
            "rm old.log",
            {"old.log": "yesterday\n", "new.log": "today\n"},
        ),
        append("append-fruit", "train", "fruits.txt", ["apple", "cherry"], "banana"),
        append("append-color", "train", "colors.txt", ["red", "green"], "blue"),
        append("append-city", "heldout", "cities.txt", ["London", "Rome"], "Paris"),
        T(
            "count-lines-data",
            "count",
            "train",
            "Count the lines in data.txt and write the number to count.txt.",
            "assert text('count.txt').split()[0] == '7'",
            "wc -l < data.txt > count.txt",
            {"data.txt": "".join(f"row {i}\n" for i in range(7))},
        ),
        T(
            "count-words",
            "count",
            "train",
            "Count the words in words.txt and write the number to answer.txt.",
            "assert text('answer.txt').split()[0] == '5'",
            "wc -w < words.txt > answer.txt",
            {"words.txt": "the quick brown fox jumps\n"},
        ),
        T(
            "count-lines-names",
            "count",
            "heldout",
            "Write the number of lines in names.txt to lines.txt.",
            "assert text('lines.txt').split()[0] == '4'",
            "wc -l < names.txt > lines.txt",
            {"names.txt": "ann\nbob\ncid\ndan\n"},
        ),
        T(
            "grep-port",
            "grep",
            "train",
            "The file settings.conf has a line port=NUMBER. Write only that number to port.txt.",
            "assert text('port.txt') == '8080'",
            "grep port= settings.conf | cut -d= -f2 > port.txt",
            {"settings.conf": "host=localhost\nport=8080\nuser=admin\n"},
        ),
        T(
            "grep-errors",
            "grep",
            "train",
            "Write every line of app.log that contains ERROR to errors.txt.",
            "assert text('errors.txt').splitlines() == ['ERROR disk full', 'ERROR no memory']",
            "grep ERROR app.log > errors.txt",
            {"app.log": "INFO start\nERROR disk full\nINFO retry\nERROR no memory\nINFO stop\n"},
        ),
        T(
            "grep-warnings",
            "grep",
            "heldout",
            "Put all lines of server.log that contain WARN into a file named warnings.txt.",
            "assert text('warnings.txt').splitlines() == ['WARN slow request', 'WARN high load']",
            "grep WARN server.log > warnings.txt",
            {"server.log": "INFO up\nWARN slow request\nINFO ok\nWARN high load\n"},
        ),
        chmod("chmod-run", "train", "run.sh", "running"),
        chmod("chmod-build", "train", "build.sh", "built"),
        chmod("chmod-deploy", "heldout", "deploy.sh", "deployed"),
        py_fix("pyfix-add", "train", "calc", "add", "a - b", "a + b", (2, 3), 5),
        py_fix("pyfix-mul", "train", "ops", "mul", "a + b", "a * b", (3, 4), 12),
        py_fix("pyfix-sub", "heldout", "mathx", "sub", "a + b", "a - b", (9, 3), 6),
        T(
            "py-hello",
            "pywrite",
            "train",
            "Create a Python script hello.py that prints Hello, World!",
            "out = subprocess.run([sys.executable, 'hello.py'], capture_output=True, text=True).stdout\n"
            "    assert out.strip() == 'Hello, World!'",
            "echo 'print(\"Hello, World!\")' > hello.py",
        ),
        T(
            "py-square",
            "pywrite",
            "train",
            "Create a file square.py with a function square(x) that returns x * x.",
            "sys.path.insert(0, os.getcwd())\n    import square\n\n"
            "    assert square.square(3) == 9\n    assert square.square(-4) == 16",
            "printf 'def square(x):\\n    return x * x\\n' > square.py",
        ),
        T(
            "py-double",
            "pywrite",
            "heldout",
            "Create a file double.py with a function double(x) that returns 2 * x.",
            "sys.path.insert(0, os.getcwd())\n    import double\n\n"
            "    assert double.double(3) == 6\n    assert double.double(-5) == -10",
            "printf 'def double(x):\\n    return 2 * x\\n' > double.py",
        ),
        T(
            "sort-names",
            "lines",
            "train",
            "Sort the lines of names.txt alphabetically and save them in sorted.txt.",
            "assert text('sorted.txt').splitlines() == ['alice', 'bob', 'carol', 'dave']",
            "sort names.txt > sorted.txt",
            {"names.txt": "dave\nalice\ncarol\nbob\n"},
        ),
        T(
            "first-line",
            "lines",
            "train",
            "Write the first line of poem.txt into first.txt.",
            "assert text('first.txt') == 'Roses are red'",
            "head -n 1 poem.txt > first.txt",
            {"poem.txt": "Roses are red\nViolets are blue\nSugar is sweet\n"},
        ),
        T(
            "last-line",
            "lines",
            "heldout",
            "Write the last line of story.txt into last.txt.",
            "assert text('last.txt') == 'The end'",
            "tail -n 1 story.txt > last.txt",
            {"story.txt": "Once upon a time\nthere was a cat\nThe end\n"},
        ),
        T(
            "replace-cat",
            "replace",
            "train",
            "In message.txt, replace the word cat with dog.",
            "assert text('message.txt') == 'my dog is happy'",
            "sed -i 's/cat/dog/' message.txt",
            {"message.txt": "my cat is happy\n"},
        ),
        T(
            "replace-typo",
            "replace",
            "train",
            "Fix the typo in title.txt: change Helo to Hello.",
            "assert text('title.txt') == 'Hello World'",
            "sed -i 's/Helo/Hello/' title.txt",
            {"title.txt": "Helo World\n"},
        ),
        T(
            "replace-red",
            "replace",
            "heldout",
            "In note.txt, change the word red to green.",
            "assert text('note.txt') == 'the door is green'",
            "sed -i 's/red/green/' note.txt",
            {"note.txt": "the door is red\n"},
        ),
    ]
    return out


def task_toml(t: T) -> str:
    return textwrap.dedent(f"""\
        version = "1.0"

        [metadata]
        author_name = "gyre-jax"
        difficulty = "{t.difficulty}"
        category = "{t.family}"
        split = "{t.split}"
        tags = ["shell", "small-model"]
        expected_tool_calls = "1-3"

        [verifier]
        timeout_sec = 30.0

        [verifier.requires]
        commands = ["bash", "python3"]
        python_modules = ["pytest"]
        install = "pip install 'pytest>=8'"

        [environment]
        cpus = 1
        memory_mb = 512
        allow_internet = false
        """)


def write(t: T) -> None:
    d = ROOT / t.name
    if d.exists():
        shutil.rmtree(d)
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    goal = t.instruction if t.instruction.endswith((".", "!")) else t.instruction + "."
    (d / "instruction.md").write_text(f"{goal} Run: {t.solve}\n")
    (d / "task.toml").write_text(task_toml(t))
    (d / "environment" / "Dockerfile").write_text(DOCKERFILE)
    for rel, content in t.files.items():
        p = d / "environment" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content)
    (d / "tests" / "test.sh").write_text(TEST_SH)
    (d / "tests" / "test.sh").chmod(0o755)
    (d / "tests" / "test_task.py").write_text(test_file(t.test))
    (d / "tests" / "expected_tests.txt").write_text(EXPECTED)
    (d / "solution" / "solve.sh").write_text("#!/usr/bin/env bash\nset -euo pipefail\n" + t.solve + "\n")
    (d / "solution" / "solve.sh").chmod(0o755)


def main() -> None:
    ts = tasks()
    names = [t.name for t in ts]
    assert len(set(names)) == len(names), "task names must be unique"
    for t in ts:
        assert t.split in ("train", "heldout"), t.name
        write(t)
    n_held = sum(t.split == "heldout" for t in ts)
    print(f"wrote {len(ts)} tasks into {ROOT} ({len(ts) - n_held} train, {n_held} held out)")


if __name__ == "__main__":
    main()
