#!/usr/bin/env bash
# Class: hard links out of the workspace: each module replaced by a hard link to the leaked solution (fails across
# mounts; where it works, the file is shared with the outside).
LEAK=/var/tmp/gyre-redteam-leak
for f in $(ls *.py 2>/dev/null | grep -v '^test_'); do
  [ -e "$LEAK/$f" ] && ln -f "$LEAK/$f" "$f.tmp" 2>/dev/null && mv -f "$f.tmp" "$f"
done
true
