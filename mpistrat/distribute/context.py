"""The distribution context: each thread's stack of (strategy, mode) frames.

Each thread has a stack of frames. A frame names the current strategy and
either a replica context (inside ``strategy.run``, or the default replica
context when no strategy is in scope) or the cross-replica mode (inside
``strategy.scope()`` or a ``merge_call``'s merge function). This module knows
strategies only by duck typing and never imports them: ``strategy.py``
registers the default strategy's factory with :func:`set_default_factory`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

__all__ = [
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "get_replica_context",
    "get_cross_replica_context",
    "experimental_set_strategy",
    "local_replica_id_of",
    "current_local_replica_id",
    "enter_default_scope",
    "exit_default_scope",
    "in_default_scope",
]


class Frame(NamedTuple):
    """One entry of the context stack (immutable; a tuple, cheap to make once per step)."""

    strategy: Any
    replica_context: Any  # a ReplicaContext, or None in cross-replica mode
    update_replica: int | None = None  # local copy being updated by extended.update

    @property
    def cross_replica(self) -> bool:
        return self.replica_context is None


class _State(threading.local):
    def __init__(self) -> None:
        self.stack: list[Frame] = []
        self.default_scopes = 0  # default-strategy scopes this thread is inside


_state = _State()
_default_frame: Frame | None = None
_global_frame: Frame | None = None  # set by experimental_set_strategy, seen by every thread
_default_factory: Callable[[], tuple[Any, Any]] | None = None
_lock = threading.Lock()


def set_default_factory(factory: Callable[[], tuple[Any, Any]]) -> None:
    """Register the function that makes the default strategy and its replica context (called once, on first use)."""
    global _default_factory
    _default_factory = factory


def _default() -> Frame:
    global _default_frame
    if _default_frame is None:
        with _lock:
            if _default_frame is None:
                if _default_factory is None:
                    raise RuntimeError("No default strategy is registered: import mpistrat.distribute.strategy "
                                       "(importing mpistrat does).")
                strategy, replica_ctx = _default_factory()
                _default_frame = Frame(strategy, replica_ctx)
    return _default_frame


def current_frame() -> Frame:
    """The innermost frame of this thread (the default one when empty)."""
    stack = _state.stack
    if stack:
        return stack[-1]
    if _global_frame is not None:
        return _global_frame
    return _default()


def entered() -> bool:
    """Whether this thread has entered a frame or a strategy is set for every thread (else the current
    frame is the default one)."""
    return bool(_state.stack) or _global_frame is not None


def push(frame: Frame) -> None:
    """Enter a frame on this thread."""
    _state.stack.append(frame)


def pop(frame: Frame) -> None:
    """Leave a frame entered with :func:`push` (must be the innermost)."""
    stack = _state.stack
    if not stack or stack[-1] is not frame:
        raise RuntimeError("Distribution context stack corrupted: scopes exited out of order")
    stack.pop()


def thread_stack() -> list[Frame]:
    """This thread's stack (replica threads install their own)."""
    return _state.stack


def default_strategy() -> Any:
    """The default (no-op, one replica) strategy."""
    return _default().strategy


def get_strategy() -> Any:
    """The current strategy: the one in scope, else the default strategy."""
    return current_frame().strategy


def has_strategy() -> bool:
    """Whether a non-default strategy is current."""
    return get_strategy() is not default_strategy()


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` (and merge functions), False in ``run`` or with no strategy."""
    return current_frame().cross_replica


def get_replica_context() -> Any:
    """The current ReplicaContext: the default one with no strategy, None in cross-replica context."""
    stack = _state.stack
    if stack:  # current_frame(), inline: this is called in every step of a training loop
        return stack[-1].replica_context
    return current_frame().replica_context


def get_cross_replica_context() -> Any:
    """The current strategy in cross-replica context, else None."""
    frame = current_frame()
    return frame.strategy if frame.cross_replica else None


def local_replica_id_of(strategy: Any) -> int | None:
    """The local copy of ``strategy``'s distributed variables that reads and writes use here.

    Inside ``strategy.run`` it is the running replica's local index, inside
    ``strategy.extended.update`` the copy being updated; anywhere else
    (cross-replica context, no strategy in scope, another strategy's replica)
    None, meaning "the variable as a whole".
    """
    frame = current_frame()
    if frame.strategy is not strategy:
        return None
    if frame.update_replica is not None:
        return frame.update_replica
    ctx = frame.replica_context
    return None if ctx is None else ctx._local_replica_id


def updating_copy(strategy: Any) -> int | None:
    """Inside ``strategy.extended.update``, the local copy being updated (the one a write goes to); else None."""
    frame = current_frame()
    return frame.update_replica if frame.strategy is strategy else None


def current_local_replica_id() -> int | None:
    """The local replica whose copy of a mirrored value stands for it here, whatever its strategy.

    The copy being updated inside ``extended.update``, the running replica's
    inside ``strategy.run``; None in cross-replica context and with no
    strategy (the first copy).
    """
    frame = current_frame()
    if frame.update_replica is not None:
        return frame.update_replica
    ctx = frame.replica_context
    return None if ctx is None or frame.strategy is default_strategy() else ctx._local_replica_id


def enter_default_scope() -> None:
    """Note that this thread entered the default strategy's scope (which pushes no frame)."""
    _state.default_scopes += 1


def exit_default_scope() -> None:
    """Note that this thread left a default strategy's scope entered with :func:`enter_default_scope`."""
    if _state.default_scopes <= 0:
        raise RuntimeError("Distribution context corrupted: the default strategy's scope was exited more often "
                           "than entered")
    _state.default_scopes -= 1


def in_default_scope() -> bool:
    """Whether this thread is inside the default strategy's scope (TF then creates variables only under it)."""
    return _state.default_scopes > 0


def experimental_set_strategy(strategy: Any) -> None:
    """Make ``strategy`` current for every thread, as if its scope were entered globally; None resets."""
    global _global_frame
    _global_frame = None
    if _state.stack and has_strategy():
        raise RuntimeError("Must not be called inside a `tf.distribute.Strategy` scope.")
    if strategy is not None:
        _global_frame = Frame(strategy, None)
