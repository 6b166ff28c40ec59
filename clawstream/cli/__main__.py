"""`python -m clawstream.cli` = the `clawstream` CLI (as `python -m clawstream`)."""

from clawstream.cli import main

main()
