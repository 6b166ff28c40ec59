"""``python -m streams [worker ...]``: same as ``python -m streams.app``."""

from streams.app import main

main()
