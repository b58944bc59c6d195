# Sourced by the hacks: inject FILE appends FILE's Python to every module of the workspace (what the tests import).
P=$(mktemp)  # the payload file (a private name: executions may share /tmp)
inject() {
  find . -maxdepth 3 -name '*.py' -not -name 'test_*' -not -name 'conftest.py' -not -path './tests/*' | while read -r f; do
    printf '\n' >> "$f"; cat "$1" >> "$f"
  done
}
