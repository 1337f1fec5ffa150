"""One module per engine plug-in for bench/connectors.py, each run in that engine's venv.

A module defines `Path(address, pages)`: the engine's own call path into the plug-in, with
`page_bytes` and `round(first) -> (set_seconds, get_seconds)`, which sets `pages` fresh pages (keys
first..first+pages-1) and then gets them back, checking the bytes; and `close()`.
"""
