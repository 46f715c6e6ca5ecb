"""`python -m maxkernel.cli` is the `maxkernel` command (the bench and the tests start it this way)."""

from maxkernel.cli import main

main()
