"""The operator console at /console (pages.py): server-rendered, no script."""
