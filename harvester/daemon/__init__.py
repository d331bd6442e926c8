"""The ``reaper`` daemon: command line, settings, structured logs, HTTP endpoints, operator tools."""
