"""The one exception type whose message is shown to users as-is."""


class ExporterError(Exception):
    """A problem the user can fix; the message is one line that says what to do."""
