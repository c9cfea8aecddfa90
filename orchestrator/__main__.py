"""``python -m orchestrator``: the ``dfo`` command, as the console script runs it."""

from orchestrator.entry import main

main()
