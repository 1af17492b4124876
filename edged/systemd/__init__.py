"""systemd integration: the notify protocol (readiness, watchdog, reload, stop) and the journal."""

from edged.journal import JournalHandler, journal_available, running_under_journal
from edged.systemd.notify import Notifier, watchdog_interval

__all__ = ["JournalHandler", "Notifier", "journal_available", "running_under_journal", "watchdog_interval"]
