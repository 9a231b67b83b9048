"""`python -m flowedge` = the `flowedge` command."""
from flowedge.cli import main

main()
