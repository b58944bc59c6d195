import pytest
from textkit.paginate import describe, page_count, paginate

ITEMS = list(range(1, 11))  # 1..10


def test_first_page_holds_first_items():
    assert paginate(ITEMS, 3, 1) == [1, 2, 3]
    assert paginate(ITEMS, 3, 2) == [4, 5, 6]


def test_last_partial_page():
    assert paginate(ITEMS, 3, 4) == [10]
    assert paginate("abcde", 2, 3) == ["e"]


def test_page_zero_is_rejected():
    with pytest.raises(IndexError):
        paginate(ITEMS, 3, 0)


def test_page_past_the_end_is_rejected():
    with pytest.raises(IndexError):
        paginate(ITEMS, 5, 3)
    assert paginate(ITEMS, 5, 2) == [6, 7, 8, 9, 10]


def test_empty_sequence_has_no_pages():
    with pytest.raises(IndexError):
        paginate([], 5, 1)


def test_page_count_values():
    assert page_count(10, 5) == 2
    assert page_count(11, 5) == 3
    assert page_count(1, 5) == 1
    assert page_count(5, 1) == 5
    with pytest.raises(ValueError):
        page_count(3, 0)


def test_page_count_of_nothing_is_zero():
    assert page_count(0, 7) == 0


def test_pages_cover_every_item_once():
    for n in range(0, 23):
        items = list(range(n))
        for size in range(1, 8):
            pages = [paginate(items, size, p) for p in range(1, page_count(n, size) + 1)]
            assert [x for chunk in pages for x in chunk] == items
            assert all(1 <= len(chunk) <= size for chunk in pages)


def test_describe_middle_page():
    assert describe(45, 10, 2) == "Showing 11-20 of 45"
    assert describe(45, 10, 1) == "Showing 1-10 of 45"


def test_describe_last_page_and_bounds():
    assert describe(45, 10, 5) == "Showing 41-45 of 45"
    assert describe(40, 10, 4) == "Showing 31-40 of 40"
    with pytest.raises(IndexError):
        describe(40, 10, 5)
    assert describe(0, 10, 1) == "No items"
