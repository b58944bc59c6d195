"""Exact matrices over fractions.Fraction."""

from fractions import Fraction


def _entry(x):
    if isinstance(x, bool) or not isinstance(x, (int, Fraction)):
        raise TypeError(f"matrix entries must be int or Fraction, got {type(x).__name__}")
    return Fraction(x)


def _is_scalar(k):
    return isinstance(k, (int, Fraction)) and not isinstance(k, bool)


def _eliminate(rows):
    """Row-reduce a copy of `rows` to echelon form; returns (echelon rows, rank, sign of the row swaps)."""
    a = [row[:] for row in rows]
    n_rows, n_cols = len(a), len(a[0])
    rank, sign = 0, 1
    for col in range(n_cols):
        pivot = next((r for r in range(rank, n_rows) if a[r][col] != 0), None)
        if pivot is None:
            continue
        if pivot != rank:
            a[rank], a[pivot] = a[pivot], a[rank]
            sign = -sign
        for r in range(rank + 1, n_rows):
            factor = a[r][col] / a[rank][col]
            if factor:
                a[r] = [x - factor * y for x, y in zip(a[r], a[rank])]
        rank += 1
        if rank == n_rows:
            break
    return a, rank, sign


class Matrix:
    def __init__(self, rows):
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) and r for r in rows):
            raise ValueError("a matrix needs a non-empty list of non-empty lists")
        if len({len(r) for r in rows}) != 1:
            raise ValueError("all rows must have the same length")
        self._rows = [[_entry(x) for x in row] for row in rows]

    @classmethod
    def identity(cls, n):
        if n < 1:
            raise ValueError("size must be >= 1")
        return cls([[int(i == j) for j in range(n)] for i in range(n)])

    @classmethod
    def zeros(cls, n_rows, n_cols):
        if n_rows < 1 or n_cols < 1:
            raise ValueError("sizes must be >= 1")
        return cls([[0] * n_cols for _ in range(n_rows)])

    @property
    def shape(self):
        return (len(self._rows), len(self._rows[0]))

    def __getitem__(self, index):
        i, j = index
        return self._rows[i][j]

    def to_list(self):
        return [row[:] for row in self._rows]

    def __eq__(self, other):
        return isinstance(other, Matrix) and self._rows == other._rows

    __hash__ = None

    def _same_shape(self, other):
        if not isinstance(other, Matrix):
            return False
        if self.shape != other.shape:
            raise ValueError(f"shapes differ: {self.shape} and {other.shape}")
        return True

    def __add__(self, other):
        if not self._same_shape(other):
            return NotImplemented
        return Matrix([[x + y for x, y in zip(a, b)] for a, b in zip(self._rows, other._rows)])

    def __sub__(self, other):
        if not self._same_shape(other):
            return NotImplemented
        return Matrix([[x - y for x, y in zip(a, b)] for a, b in zip(self._rows, other._rows)])

    def __mul__(self, k):
        if not _is_scalar(k):
            return NotImplemented
        return Matrix([[x * k for x in row] for row in self._rows])

    __rmul__ = __mul__

    def __matmul__(self, other):
        if not isinstance(other, Matrix):
            return NotImplemented
        if self.shape[1] != other.shape[0]:
            raise ValueError(f"cannot multiply {self.shape} by {other.shape}")
        cols = list(zip(*other._rows))
        return Matrix([[sum((x * y for x, y in zip(row, col)), Fraction(0)) for col in cols] for row in self._rows])

    def transpose(self):
        return Matrix([list(col) for col in zip(*self._rows)])

    def _square(self, what):
        if self.shape[0] != self.shape[1]:
            raise ValueError(f"{what} needs a square matrix, got shape {self.shape}")

    def determinant(self):
        self._square("determinant")
        echelon, rank, sign = _eliminate(self._rows)
        if rank < self.shape[0]:
            return Fraction(0)
        det = Fraction(sign)
        for i, row in enumerate(echelon):
            det *= row[i]
        return det

    def inverse(self):
        self._square("inverse")
        n = self.shape[0]
        aug = [row[:] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(self._rows)]
        for col in range(n):
            pivot = next((r for r in range(col, n) if aug[r][col] != 0), None)
            if pivot is None:
                raise ValueError("the matrix is singular (determinant 0): it has no inverse")
            aug[col], aug[pivot] = aug[pivot], aug[col]
            p = aug[col][col]
            aug[col] = [x / p for x in aug[col]]
            for r in range(n):
                if r != col and aug[r][col] != 0:
                    f = aug[r][col]
                    aug[r] = [x - f * y for x, y in zip(aug[r], aug[col])]
        return Matrix([row[n:] for row in aug])

    def rank(self):
        return _eliminate(self._rows)[1]

    def __str__(self):
        cells = [[str(x) for x in row] for row in self._rows]
        widths = [max(len(c) for c in col) for col in zip(*cells)]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)

    def __repr__(self):
        return f"Matrix({[[str(x) for x in row] for row in self._rows]})"
