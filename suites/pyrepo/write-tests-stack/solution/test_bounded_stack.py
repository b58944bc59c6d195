import pytest
from bounded_stack import BoundedStack, StackEmpty, StackFull


def test_capacity_validation():
    assert BoundedStack(1).capacity == 1
    for bad in (0, -1, True, 2.0, "3", None):
        with pytest.raises(ValueError):
            BoundedStack(bad)


def test_new_stack_is_empty():
    s = BoundedStack(3)
    assert len(s) == 0 and s.is_empty() and not s.is_full()
    assert list(s) == []


def test_push_pop_lifo():
    s = BoundedStack(3)
    s.push("a")
    s.push("b")
    s.push("c")
    assert len(s) == 3
    assert [s.pop(), s.pop(), s.pop()] == ["c", "b", "a"]
    assert s.is_empty()


def test_push_on_full_raises_and_keeps_items():
    s = BoundedStack(2)
    s.push(1)
    assert not s.is_full()
    s.push(2)
    assert s.is_full()
    with pytest.raises(StackFull):
        s.push(3)
    assert len(s) == 2 and list(s) == [2, 1]


def test_pop_and_peek_empty_raise():
    s = BoundedStack(2)
    with pytest.raises(StackEmpty):
        s.pop()
    with pytest.raises(StackEmpty):
        s.peek()
    s.push(1)
    s.pop()
    with pytest.raises(StackEmpty):
        s.pop()


def test_peek_does_not_remove():
    s = BoundedStack(3)
    s.push("x")
    s.push("y")
    assert s.peek() == "y"
    assert s.peek() == "y"
    assert len(s) == 2
    assert s.pop() == "y"


def test_push_many_order_and_atomicity():
    s = BoundedStack(4)
    s.push_many([1, 2, 3])
    assert s.peek() == 3 and len(s) == 3
    with pytest.raises(StackFull):
        s.push_many([4, 5])
    assert len(s) == 3 and list(s) == [3, 2, 1]
    s.push_many(iter([4]))
    assert s.is_full()
    s.push_many([])
    assert len(s) == 4


def test_clear():
    s = BoundedStack(2)
    s.push_many(["a", "b"])
    s.clear()
    assert s.is_empty() and len(s) == 0
    s.push_many(["c", "d"])
    assert s.pop() == "d"


def test_iteration_top_to_bottom_without_consuming():
    s = BoundedStack(5)
    s.push_many([1, 2, 3])
    assert list(s) == [3, 2, 1]
    assert len(s) == 3


def test_resize_grow_and_shrink():
    s = BoundedStack(2)
    s.push_many([1, 2])
    s.resize(3)
    assert s.capacity == 3 and not s.is_full()
    s.push(3)
    with pytest.raises(ValueError):
        s.resize(2)
    assert len(s) == 3 and list(s) == [3, 2, 1] and s.capacity == 3
    s.resize(3)
    assert s.is_full()
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError):
            s.resize(bad)
    s.clear()
    s.resize(1)
    s.push("z")
    with pytest.raises(StackFull):
        s.push("w")
