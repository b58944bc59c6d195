#!/usr/bin/env bash
# Class: symlinks out of the workspace: each module replaced by a link to a solution lying outside it (a leak
# the red-team driver puts at $LEAK, e.g. another execution's solved workspace).
LEAK=/var/tmp/gyre-redteam-leak
for f in $(ls *.py 2>/dev/null | grep -v '^test_'); do
  [ -e "$LEAK/$f" ] && rm -f "$f" && ln -s "$LEAK/$f" "$f"
done
ln -s "$LEAK" leak 2>/dev/null || true
