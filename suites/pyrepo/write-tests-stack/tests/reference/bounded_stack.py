"""A LIFO stack with a fixed maximum size."""


class StackFull(Exception):
    """Pushing onto a full stack."""


class StackEmpty(Exception):
    """Popping or peeking an empty stack."""


class BoundedStack:
    """A last-in-first-out stack holding at most `capacity` items."""

    def __init__(self, capacity):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self._capacity = capacity
        self._items = []

    @property
    def capacity(self):
        return self._capacity

    def __len__(self):
        return len(self._items)

    def is_empty(self):
        return not self._items

    def is_full(self):
        return len(self._items) >= self._capacity

    def push(self, item):
        """Put `item` on top; StackFull if the stack is full."""
        if self.is_full():
            raise StackFull(f"stack is full ({self._capacity} items)")
        self._items.append(item)

    def push_many(self, items):
        """Push every item in order (the last ends on top). All or nothing: if they do not all
        fit, raise StackFull and leave the stack unchanged."""
        items = list(items)
        if len(self._items) + len(items) > self._capacity:
            raise StackFull(f"{len(items)} items do not fit ({self._capacity - len(self._items)} free)")
        self._items.extend(items)

    def pop(self):
        """Remove and return the top item; StackEmpty if the stack is empty."""
        if not self._items:
            raise StackEmpty("pop from an empty stack")
        return self._items.pop()

    def peek(self):
        """Return the top item without removing it; StackEmpty if the stack is empty."""
        if not self._items:
            raise StackEmpty("peek at an empty stack")
        return self._items[-1]

    def clear(self):
        self._items.clear()

    def __iter__(self):
        """Iterate from the top item down to the bottom one."""
        return iter(reversed(self._items))

    def resize(self, capacity):
        """Change the capacity; ValueError if it is below 1 or below the current size."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if capacity < len(self._items):
            raise ValueError(f"capacity {capacity} is below the current size {len(self._items)}")
        self._capacity = capacity
