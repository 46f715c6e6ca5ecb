"""`python -m maxkernel` is the `maxkernel` command."""

from maxkernel.cli import main

main()
