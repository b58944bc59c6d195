from fractions import Fraction as F

import pytest
from matrix import Matrix


def hilbert(n):
    return Matrix([[F(1, i + j + 1) for j in range(n)] for i in range(n)])


def test_construction_shape_and_entries():
    m = Matrix([[1, F(1, 2), 3], [4, 5, F(-6, 4)]])
    assert m.shape == (2, 3)
    assert m[0, 1] == F(1, 2) and m[1, 2] == F(-3, 2)
    assert all(type(x) is F for row in m.to_list() for x in row)
    assert m.to_list() == [[1, F(1, 2), 3], [4, 5, F(-3, 2)]]


def test_construction_errors():
    for bad in ([], [[]], [[1, 2], [3]], [[1], []]):
        with pytest.raises(ValueError):
            Matrix(bad)
    for bad in ([[1.0]], [[True]], [["1/2"]], [[None, 1]]):
        with pytest.raises(TypeError):
            Matrix(bad)


def test_no_aliasing():
    rows = [[1, 2], [3, 4]]
    m = Matrix(rows)
    rows[0][0] = 99
    out = m.to_list()
    out[1][1] = 77
    assert m[0, 0] == 1 and m[1, 1] == 4


def test_identity_zeros_and_equality():
    assert Matrix.identity(2) == Matrix([[1, 0], [0, 1]])
    assert Matrix.zeros(2, 3) == Matrix([[0, 0, 0], [0, 0, 0]])
    assert Matrix.zeros(2, 3).shape == (2, 3)
    assert Matrix([[1]]) != Matrix([[1, 0]])
    assert (Matrix([[1]]) == [[1]]) is False
    with pytest.raises(ValueError):
        Matrix.identity(0)


def test_add_sub_and_scalar():
    a = Matrix([[1, 2], [3, 4]])
    b = Matrix([[F(1, 2), 0], [0, F(1, 3)]])
    assert a + b == Matrix([[F(3, 2), 2], [3, F(13, 3)]])
    assert a - b == Matrix([[F(1, 2), 2], [3, F(11, 3)]])
    assert a * F(1, 2) == Matrix([[F(1, 2), 1], [F(3, 2), 2]])
    assert 3 * a == Matrix([[3, 6], [9, 12]])
    assert a == Matrix([[1, 2], [3, 4]])
    with pytest.raises(ValueError):
        a + Matrix([[1, 2]])
    with pytest.raises(ValueError):
        a - Matrix([[1], [2]])


def test_matmul_and_transpose():
    a = Matrix([[1, 2, 3], [4, 5, 6]])
    b = Matrix([[7, 8], [9, 10], [11, 12]])
    assert a @ b == Matrix([[58, 64], [139, 154]])
    assert (a @ b).shape == (2, 2) and (b @ a).shape == (3, 3)
    assert a.transpose() == Matrix([[1, 4], [2, 5], [3, 6]])
    assert (a @ b).transpose() == b.transpose() @ a.transpose()
    with pytest.raises(ValueError):
        a @ a


def test_determinant():
    assert Matrix([[5]]).determinant() == 5
    assert Matrix([[1, 2], [3, 4]]).determinant() == -2
    assert Matrix([[0, 1], [1, 0]]).determinant() == -1
    assert Matrix([[2, 0, 1], [1, 3, 2], [1, 1, 2]]).determinant() == 6
    assert Matrix([[1, 2], [2, 4]]).determinant() == 0
    assert Matrix([[0, 0, 1], [0, 1, 0], [1, 0, 0]]).determinant() == -1
    assert hilbert(6).determinant() == F(1, 186313420339200000)
    assert type(Matrix([[F(1, 2), 1], [1, 1]]).determinant()) is F
    with pytest.raises(ValueError):
        Matrix([[1, 2, 3], [4, 5, 6]]).determinant()


def test_inverse():
    a = Matrix([[4, 7], [2, 6]])
    assert a.inverse() == Matrix([[F(3, 5), F(-7, 10)], [F(-1, 5), F(2, 5)]])
    p = Matrix([[0, 1, 2], [1, 0, 3], [4, -3, 8]])
    assert p @ p.inverse() == Matrix.identity(3)
    assert p.inverse() @ p == Matrix.identity(3)
    h = hilbert(5).inverse()
    assert h[0, 0] == 25 and h[4, 4] == 44100 and all(x.denominator == 1 for row in h.to_list() for x in row)


def test_inverse_errors():
    with pytest.raises(ValueError):
        Matrix([[1, 2], [2, 4]]).inverse()
    with pytest.raises(ValueError):
        Matrix([[0, 0], [0, 0]]).inverse()
    with pytest.raises(ValueError):
        Matrix([[1, 2, 3]]).inverse()


def test_rank():
    assert Matrix.identity(4).rank() == 4
    assert Matrix([[1, 2], [2, 4]]).rank() == 1
    assert Matrix.zeros(3, 2).rank() == 0
    assert Matrix([[1, 2, 3], [4, 5, 6], [7, 8, 9]]).rank() == 2
    assert Matrix([[1, 2, 3, 4], [2, 4, 6, 8]]).rank() == 1
    assert Matrix([[0, 1], [0, 2], [1, 0]]).rank() == 2
    assert Matrix([[0, 0, 1], [0, 0, 2]]).rank() == 1


def test_str_alignment():
    m = Matrix([[1, F(-1, 2)], [F(3, 4), 2]])
    assert str(m) == "  1  -1/2\n3/4     2"
    assert str(Matrix([[0]])) == "0"
    assert str(Matrix([[10, 0], [-1, F(22, 7)]])) == "10     0\n-1  22/7"
