"""`python -m clawstream` = the `clawstream` CLI."""

from clawstream.cli import main

main()
