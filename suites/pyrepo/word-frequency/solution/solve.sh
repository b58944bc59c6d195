#!/usr/bin/env bash
set -euo pipefail
cat > wordfreq.py <<'EOF'
"""Word frequency counting."""

import argparse
import sys


def tokenize(text):
    text = text.replace("\u2019", "'").lower()
    tokens, cur = [], []
    for ch in text + " ":
        if ch.isalnum() or ch == "'":
            cur.append(ch)
        elif cur:
            tokens.append("".join(cur))
            cur = []
    out = []
    for tok in tokens:
        tok = tok.strip("'")
        if tok:
            out.append(tok)
    return out


def _normalize(word):
    toks = tokenize(word)
    return toks[0] if len(toks) == 1 else word.replace("\u2019", "'").lower().strip().strip("'")


def count_words(text, stop_words=()):
    stops = {_normalize(w) for w in stop_words}
    counts = {}
    for tok in tokenize(text):
        if tok not in stops:
            counts[tok] = counts.get(tok, 0) + 1
    return counts


def top_k(counts, k):
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


def load_stop_words(path):
    words = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            words.add(_normalize(s))
    return words


def main(argv=None):
    p = argparse.ArgumentParser(prog="wordfreq")
    p.add_argument("file")
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--stop-words")
    args = p.parse_args(argv)
    if args.k < 1:
        print(f"error: -k must be >= 1, got {args.k}", file=sys.stderr)
        return 2
    try:
        stops = load_stop_words(args.stop_words) if args.stop_words else set()
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for word, n in top_k(count_words(text, stops), args.k):
        print(f"{word}\t{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
EOF
