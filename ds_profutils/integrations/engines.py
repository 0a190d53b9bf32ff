"""Follow the engines a framework builds, one after the other, as one named series of records.

A transformers ``Trainer`` or a Lightning ``Trainer`` builds its DeepSpeed engine when training
starts, and may build a new one for a later ``train()``/``fit()`` (a resumed run).  The adapters tell
:class:`FollowedEngines` when an engine is ready and when the framework is done with it; every engine
after the first is attached under the first one's name, so its records are appended to the same file
rather than starting an "engine1" file beside it.

The attachment is held weakly (the engine holds it while attached): frameworks have no event for a
run that raised, so after a failed ``train()`` nobody says the engine is done with, and a strong hold
here would keep its parameters and optimizer state resident while the framework builds the next one
(``auto_find_batch_size``), when memory is shortest.  A dropped engine is collected with its
attachment; the records finished so far are on disk.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Optional

__all__ = ["FollowedEngines", "FollowingCallback"]


class FollowedEngines:
    """The attachment to the engine a framework trains with now, and the name its records go under."""

    def __init__(self, name: Optional[str], config: Any, options: Dict[str, Any]) -> None:
        self.name: Optional[str] = None  # the series' name, once an attachment has it ("main", "engine1", ...)
        self._requested = name
        self._attachment: Optional[weakref.ref] = None
        self.closed = False
        self._config = config
        self._options = options

    def begin(self, engine: Any, live_sink: Any = None) -> None:
        """``engine`` is what the framework trains with from now on: attach to it (again, if it is the last one);
        ``live_sink`` (a :mod:`.live_sinks` sink) takes the live events into the framework's own reporting."""
        from ..engine import attach, continue_series

        if self.closed:
            return
        self.end()  # the framework never said it was done with the last one (an exception ended its run)
        name = self._requested
        if self.name is not None:  # the series has a name: this engine continues it, and its file is appended to
            continue_series(engine, self.name)
            name = None  # attach takes the engine's own name
        attachment = attach(engine, name, config=self._config, **self._options)
        self._attachment = None if attachment is None else weakref.ref(attachment)
        if attachment is not None and live_sink is not None:
            attachment.report_to(live_sink)
        if attachment is not None and attachment.name is not None:
            self.name = attachment.name

    @property
    def attachment(self) -> Any:
        """The attachment to the engine trained with now; None when there is none, or its engine was dropped."""
        return None if self._attachment is None else self._attachment()

    def end(self) -> None:
        """The framework is done with the engine: write what is finished and give the engine back."""
        attachment, self._attachment = self.attachment, None
        if attachment is not None:
            attachment.close()

    def close(self) -> None:
        """Stop following: the current engine is given back and later ones are not attached."""
        self.end()
        self.closed = True


class FollowingCallback:
    """What a framework callback built on :class:`FollowedEngines` shows its user (``_engines`` is set by it)."""

    _engines: FollowedEngines

    @property
    def attachment(self) -> Any:
        """The current engine's ``Attachment``: None between runs, or when the config asks nothing."""
        return self._engines.attachment

    @property
    def name(self) -> Optional[str]:
        """The engine name the records go under, once the first engine was attached."""
        return self._engines.name
